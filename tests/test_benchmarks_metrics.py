"""SumMetrics after the loop-overhead fix: integer counts summed on the host, exactly, and resumable."""

from __future__ import annotations

import torch

from common.pytorch.metrics import SumMetrics, ratio


def feed(metrics: SumMetrics, steps: range) -> None:
    for step in steps:
        logits = torch.linspace(-1, 1, 40).reshape(4, 10) * (step + 1)
        labels = torch.tensor([step % 10, 1, 2, 3])
        loss = torch.nn.functional.cross_entropy(logits, labels)
        metrics.add(loss=loss.detach() * 4, correct=(logits.argmax(1) == labels).sum(), count=4,
                    per_sample=torch.full((4,), 0.25), weight=0.5)


def test_sums_mix_tensors_integers_and_floats() -> None:
    metrics = SumMetrics(torch.device("cpu"))
    metrics.add(count=3, correct=torch.tensor(2), loss=torch.tensor([0.5, 0.25]), weight=1.5)
    metrics.add(count=5, correct=torch.tensor(4), flag=True)
    totals = metrics.reduce()
    assert totals == {"count": 8.0, "correct": 6.0, "loss": 0.75, "weight": 1.5, "flag": 1.0}
    assert ratio(totals, "correct", "count") == 0.75
    metrics.reset()
    assert metrics.reduce() == {}


def test_counts_alone_need_no_device_tensor() -> None:
    metrics = SumMetrics(torch.device("cpu"))
    metrics.add(count=2**40)
    metrics.add(count=1)
    assert metrics.reduce() == {"count": float(2**40 + 1)}
    state = metrics.state_dict()
    assert state["count"].dtype == torch.float64 and state["count"].item() == 2**40 + 1


def test_resuming_midway_reduces_to_the_same_bits() -> None:
    uninterrupted = SumMetrics(torch.device("cpu"))
    feed(uninterrupted, range(10))

    first_segment = SumMetrics(torch.device("cpu"))
    feed(first_segment, range(6))
    state = {name: value.clone() for name, value in first_segment.state_dict().items()}
    resumed = SumMetrics(torch.device("cpu"))
    resumed.load_state_dict(state)
    feed(resumed, range(6, 10))

    assert resumed.reduce() == uninterrupted.reduce()
    assert set(state) == {"loss", "correct", "count", "per_sample", "weight"}
