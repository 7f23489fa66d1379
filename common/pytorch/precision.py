"""Mixed precision as a config switch: fp32, bf16 (autocast) or fp16 (autocast + grad scaler)."""

from __future__ import annotations

import contextlib

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision not in _DTYPES:
        raise ValueError(f"precision must be fp32, bf16 or fp16, not {precision!r}")
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """A scaler that is active only for fp16 (bf16 and fp32 need none)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
