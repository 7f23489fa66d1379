"""Per-batch code that must not make the host wait for a GPU, checked on the CPU by the operators it runs.

On CUDA an operator whose output size depends on the data (boolean-mask indexing, ``nonzero``,
``masked_select``, ``bincount``) or that reads a value back (``.item()``) synchronises the host
with the device. The same operators show on the CPU, so a dispatch mode that records them
catches such code here; ``make gpu-check`` checks the real thing with
``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common.pytorch.metrics import SumMetrics
from recipes.fungitastic.metrics import TaxonomyMetrics, species_marginals
from recipes.tv_segmentation.metrics import ConfusionMatrix

aten = torch.ops.aten
SYNCING = {aten.nonzero.default, aten.masked_select.default, aten.bincount.default, aten._local_scalar_dense.default}


class SyncingOps(TorchDispatchMode):
    """Records the operators that would synchronise the host with a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (PyTorch's protocol)
        bool_index = func is aten.index.Tensor and any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in args[1]
        )
        if func in SYNCING or bool_index:
            self.seen.append(f"{func}{' with a boolean mask' if bool_index else ''}")
        return func(*args, **(kwargs or {}))


def syncing_ops(action: Callable[[], object]) -> list[str]:
    with SyncingOps() as mode:
        action()
    return mode.seen


def test_the_detector_sees_boolean_masks_and_bincount() -> None:
    values = torch.tensor([0, 3, 1, 3])
    assert syncing_ops(lambda: values[values > 0]) == ["aten.index.Tensor with a boolean mask"]
    assert syncing_ops(lambda: torch.bincount(values)) == ["aten.bincount.default"]


def test_segmentation_confusion_matrix_update_does_not_sync() -> None:
    matrix = ConfusionMatrix(num_classes=4, device=torch.device("cpu"))
    target = torch.tensor([[0, 0, 1, 255], [3, 255, 1, 0]])
    prediction = torch.tensor([[0, 1, 1, 2], [3, 0, 2, 0]])
    assert syncing_ops(lambda: matrix.update(target, prediction)) == []
    assert matrix.reduce().sum() == 6  # the two 255 pixels are not counted


def test_fungitastic_metrics_per_batch_do_not_sync() -> None:
    parents = {"genus": torch.tensor([0, 0, 1, -1])}
    metrics = TaxonomyMetrics({"species": 4, "genus": 2}, parents, torch.device("cpu"))
    logits = torch.randn(5, 4)
    labels = torch.tensor([0, 2, -1, 3, 1])

    def one_batch() -> None:
        metrics.add_loss(torch.tensor(1.5), 5)
        metrics.add_level("species", logits, labels)
        metrics.add_consistency({"species": logits.argmax(1), "genus": torch.tensor([0, 1, 0, 1, 0])})
        species_marginals(logits, parents["genus"], 2)

    assert syncing_ops(one_batch) == []
    assert metrics.reduce()["species/count"].item() == 4  # the label -1 is not counted


def test_summing_train_metrics_does_not_sync() -> None:
    sums = SumMetrics(torch.device("cpu"))
    loss, logits, labels = torch.tensor(0.7), torch.randn(8, 3), torch.randint(0, 3, (8,))
    assert syncing_ops(lambda: sums.add(loss=loss * 8, correct=(logits.argmax(1) == labels).sum(), count=8)) == []
