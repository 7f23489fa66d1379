"""``trainer.deterministic``: PyTorch's switches for bit-identical GPU runs, or the fast CUDA defaults."""

from __future__ import annotations

import os

import pytest
import torch

from common.determinism import CUBLAS_WORKSPACE, configure_determinism


@pytest.fixture
def restore_defaults() -> None:
    yield
    configure_determinism(False, "cpu")


def test_deterministic_sets_every_switch_cuda_needs(monkeypatch: pytest.MonkeyPatch, restore_defaults: None) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    configure_determinism(True, "auto")
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"


def test_otherwise_tf32_and_cudnn_autotuning_on_cuda_only(monkeypatch: pytest.MonkeyPatch,
                                                          restore_defaults: None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    configure_determinism(True, "auto")
    configure_determinism(False, "auto")  # a run in the same process after a deterministic one
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    configure_determinism(False, "cpu")
    assert not torch.backends.cudnn.benchmark
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
