"""``trainer.deterministic``: PyTorch's switches for bit-identical GPU runs, or the fast CUDA defaults."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.pytorch.determinism import CUBLAS_WORKSPACE, configure_determinism


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


@pytest.mark.parametrize("deterministic", [False, True])
def test_both_tf32_apis_read_the_setting(monkeypatch: pytest.MonkeyPatch, restore_defaults: None,
                                         deterministic: bool) -> None:
    """The legacy readers (which Inductor's autotuning uses) and the new one agree, and none
    raises "mix of the legacy and new APIs"; CPU (oneDNN) matmuls keep their precision."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cpu_precision = torch.backends.mkldnn.matmul.fp32_precision
    configure_determinism(deterministic, "auto")
    tf32 = not deterministic
    assert torch.backends.cuda.matmul.allow_tf32 is tf32
    assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")
    assert torch.backends.cuda.matmul.fp32_precision == ("tf32" if tf32 else "ieee")
    assert torch.backends.mkldnn.matmul.fp32_precision == cpu_precision


def test_a_flag_already_right_leaves_inductor_unimported() -> None:
    """torch.use_deterministic_algorithms imports Inductor (over a second of CPU): a process whose
    flag is already right skips it, so a run that stops on a bad input says so sooner."""
    code = ("import sys; from common.pytorch.determinism import configure_determinism; "
            "configure_determinism(False, 'cpu'); print('torch._inductor' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
