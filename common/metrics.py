"""Running sums reduced exactly across ranks, and only when someone reads them.

Ratios such as accuracy are computed from reduced sums (total correct / total count), never
as an average of per-rank averages. Values stay on the device between reads, so adding to
them does not synchronise the host with the GPU.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist


class SumMetrics:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._dtype = torch.float64 if device.type in ("cpu", "cuda") else torch.float32
        self._sums: dict[str, torch.Tensor] = {}

    def add(self, **values: torch.Tensor | float | int) -> None:
        """Add to the named sums; tensors are detached and summed over all their elements."""
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                value = value.detach().to(self.device, self._dtype).sum()
            else:
                value = torch.tensor(float(value), device=self.device, dtype=self._dtype)
            if name in self._sums:
                self._sums[name] += value
            else:
                self._sums[name] = value.clone()

    def reduce(self) -> dict[str, float]:
        """The sums over every rank (a collective: all ranks must call it). One host sync."""
        if not self._sums:
            return {}
        names = sorted(self._sums)
        stacked = torch.stack([self._sums[name] for name in names])
        if dist.is_initialized():
            dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
        return dict(zip(names, stacked.tolist()))

    def reset(self) -> None:
        self._sums.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: value.detach().cpu() for name, value in self._sums.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self._sums = {name: value.to(self.device, self._dtype) for name, value in state.items()}


def ratio(sums: Mapping[str, float], numerator: str, denominator: str) -> float:
    """``sums[numerator] / sums[denominator]``, or NaN when nothing was counted."""
    count = sums.get(denominator, 0.0)
    return sums.get(numerator, 0.0) / count if count else float("nan")
