"""mIoU, per-class IoU and pixel accuracy from one confusion matrix, summed exactly over ranks."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


class ConfusionMatrix:
    """Counts of (true class, predicted class) pixels, kept on the device as int64.

    Pixels whose target is outside ``0..num_classes-1`` (the 255 "ignore" label, padding)
    are not counted. :meth:`reduce` sums the counts of every rank with one ``all_reduce``:
    integer sums, so the result does not depend on the number of ranks or batch sizes.
    """

    def __init__(self, num_classes: int, device: torch.device) -> None:
        self.num_classes = num_classes
        self.counts = torch.zeros(num_classes * num_classes, dtype=torch.int64, device=device)

    def update(self, target: torch.Tensor, prediction: torch.Tensor) -> None:
        """Add a batch. No host sync on CUDA: no boolean-mask indexing (its size depends on the
        data) and no ``bincount`` (it reads its output size back); pixels not counted are
        added with weight 0 at index 0."""
        target, prediction = target.reshape(-1), prediction.reshape(-1)
        counted = (target >= 0) & (target < self.num_classes)
        pairs = torch.where(counted, target.long() * self.num_classes + prediction.long(), 0)
        self.counts.index_add_(0, pairs, counted.long())

    def reduce(self) -> torch.Tensor:
        """The ``[num_classes, num_classes]`` matrix over every rank (collective); rows are truth."""
        counts = self.counts.clone()
        if dist.is_initialized():
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        return counts.reshape(self.num_classes, self.num_classes).cpu()


def segmentation_scores(matrix: torch.Tensor) -> dict[str, object]:
    """Pixel accuracy, per-class IoU and their mean, from a confusion matrix.

    A class that is neither in the targets nor predicted has no IoU (NaN) and is left out
    of the mean; a class that is only predicted has IoU 0 and counts.
    """
    matrix = matrix.double()
    true_positives = matrix.diagonal()
    union = matrix.sum(1) + matrix.sum(0) - true_positives
    iou = [float(tp / u) if u > 0 else math.nan for tp, u in zip(true_positives, union)]
    scored = [value for value in iou if not math.isnan(value)]
    total = float(matrix.sum())
    return {
        "pixel_accuracy": float(true_positives.sum()) / total if total else math.nan,
        "miou": sum(scored) / len(scored) if scored else math.nan,
        "iou": iou,
    }
