"""Running sums reduced exactly across ranks, and only when someone reads them.

- Ratios (accuracy) come from reduced sums (total correct / total count), never averages of averages.
- Tensors stay on the device between reads (adding makes no host sync); plain integers (sample
  counts) are summed exactly on the host.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F


class SumMetrics:
    """Named running sums on ``device`` (float64 where the device has it), reduced by :meth:`reduce`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._dtype = torch.float64 if device.type in ("cpu", "cuda") else torch.float32
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}  # plain integers, summed exactly on the host

    def add(self, **values: torch.Tensor | float | int) -> None:
        """Add to the named sums; tensors are detached and summed over all their elements."""
        for name, value in values.items():
            if isinstance(value, int):
                self._counts[name] = self._counts.get(name, 0) + value
                continue
            if isinstance(value, torch.Tensor):
                value = value.detach().to(self.device)
                if value.dim():
                    value = value.to(self._dtype).sum()
            else:
                value = torch.tensor(float(value), device=self.device, dtype=self._dtype)
            if name in self._sums:
                # a new tensor, promoted to the sum's dtype (one kernel): a snapshot holds the old one as it was
                self._sums[name] = self._sums[name] + value
            else:
                self._sums[name] = value.to(self._dtype, copy=True)

    def running(self, name: str) -> torch.Tensor | None:
        """The running sum ``name`` of the tensors added so far, on the device (no host sync), or None."""
        return self._sums.get(name)

    def _totals(self, names: list[str]) -> torch.Tensor:
        """The sums of ``names`` as one tensor on the device (this rank only)."""
        counts = torch.tensor([float(self._counts.get(name, 0)) for name in names], dtype=self._dtype)
        if not self._sums:
            return counts.to(self.device)
        zero = torch.zeros((), device=self.device, dtype=self._dtype)
        return torch.stack([self._sums.get(name, zero) for name in names]) + counts.to(self.device)

    def reduce(self) -> dict[str, float]:
        """The sums over every rank. Collective: all ranks must call it; one host sync."""
        names = sorted(set(self._sums) | set(self._counts))
        if not names:
            return {}
        stacked = self._totals(names)
        if dist.is_initialized():
            dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
        return dict(zip(names, stacked.tolist()))

    def reset(self) -> None:
        self._sums.clear()
        self._counts.clear()

    def snapshot(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """The sums as they are now, for :meth:`restore` (no copy: :meth:`add` makes new tensors)."""
        return dict(self._sums), dict(self._counts)

    def restore(self, snapshot: tuple[dict[str, torch.Tensor], dict[str, int]]) -> None:
        """The sums as :meth:`snapshot` found them (a step that is done again adds its samples once)."""
        self._sums, self._counts = dict(snapshot[0]), dict(snapshot[1])

    def state_dict(self) -> dict[str, torch.Tensor]:
        names = sorted(set(self._sums) | set(self._counts))
        return dict(zip(names, self._totals(names).detach().cpu().unbind())) if names else {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self._sums = {name: value.to(self.device, self._dtype) for name, value in state.items()}
        self._counts = {}


def ratio(sums: Mapping[str, float], numerator: str, denominator: str) -> float:
    """``sums[numerator] / sums[denominator]``, or NaN when nothing was counted."""
    count = sums.get(denominator, 0.0)
    return sums.get(numerator, 0.0) / count if count else float("nan")


def add_classification(sums: SumMetrics, logits: torch.Tensor, labels: torch.Tensor,
                       keep: torch.Tensor | None = None) -> None:
    """Add a batch's summed cross-entropy, top-1 and top-5 hits and count to ``sums``.

    ``keep``: a mask of the samples to count (the others are padding)."""
    logits = logits.float()
    hits = logits.topk(min(5, logits.shape[1]), dim=1).indices == labels[:, None]
    top1, top5 = hits[:, 0], hits.any(dim=1)
    if keep is None:
        sums.add(loss=F.cross_entropy(logits, labels, reduction="sum"), top1=top1.sum(), top5=top5.sum(),
                 count=len(labels))
    else:
        sums.add(loss=F.cross_entropy(logits, labels, reduction="none") * keep, top1=top1 & keep, top5=top5 & keep,
                 count=keep)


def classification_metrics(totals: Mapping[str, float], prefix: str) -> dict[str, float]:
    """``<prefix>/loss``, ``<prefix>/top1`` and ``<prefix>/top5`` from :func:`add_classification`'s reduced sums."""
    return {f"{prefix}/{name}": ratio(totals, name, "count") for name in ("loss", "top1", "top5")}
