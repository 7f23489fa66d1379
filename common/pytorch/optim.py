"""Optimizer helpers every recipe wants: batch-size bookkeeping, LR scaling, weight-decay groups, LR schedules.

The schedules are plain ``LambdaLR``s: they resume exactly with the scheduler's state."""

from __future__ import annotations

import math

import torch

from common.errors import UserError


def accumulation_steps(global_batch_size: int | None, micro_batch_size: int, world_size: int) -> int:
    """Micro-batches per optimizer step that keep the batch at ``global_batch_size`` on any number of ranks.

    1 when no global batch size is set; ``UserError`` when it is not a multiple of batch x ranks."""
    if not global_batch_size:
        return 1
    per_step = micro_batch_size * world_size
    if global_batch_size % per_step:
        raise UserError(
            f"trainer.global_batch_size={global_batch_size} is not a multiple of "
            f"trainer.batch_size={micro_batch_size} x {world_size} rank(s)"
        )
    return global_batch_size // per_step


def scaled_lr(base_lr: float, batch_size: int, reference_batch_size: int, rule: str) -> float:
    """``base_lr`` (tuned for ``reference_batch_size``) scaled to ``batch_size`` by ``rule``: none, linear or sqrt."""
    if rule == "none":
        return base_lr
    if rule == "linear":
        return base_lr * batch_size / reference_batch_size
    if rule == "sqrt":
        return base_lr * math.sqrt(batch_size / reference_batch_size)
    raise ValueError(f"lr scaling rule must be none, linear or sqrt, not {rule!r}")


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two parameter groups: decay on weights of dimension >= 2, none on norms, biases and other 1-d ones."""
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup from ~0 to the base LR, then cosine decay to ``min_lr_ratio`` x base."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def warmup_multistep(
    optimizer: torch.optim.Optimizer, warmup_steps: int, milestone_steps: list[int], gamma: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup, then the LR times ``gamma`` per milestone passed (the classic ResNet step decay)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return gamma ** sum(step >= milestone for milestone in milestone_steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
