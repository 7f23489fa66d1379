"""``trainer.deterministic``: bit-identical runs on a GPU, or the fast defaults when not asked for.

- The CPU is deterministic as it is. On CUDA, cuDNN autotuning and atomic accumulation (cuDNN weight
  gradients, bilinear ``interpolate`` backward, scatter-adds) make runs differ in the last bits.
- ``true``: deterministic kernels (or a loud failure where none exists), no autotuning, cuBLAS's fixed
  workspace; a resumed run ends with the same ``model_digest`` on the same GPU model and software.
- ``false`` on CUDA: TF32 fp32 matmuls and cuDNN autotuning.
"""

from __future__ import annotations

import os

import torch

from common.pytorch.distributed import wants_cuda

# cuBLAS is deterministic only with a fixed workspace; it reads this when its first handle is made.
CUBLAS_WORKSPACE = ":4096:8"


def configure_determinism(deterministic: bool, device_preference: str) -> None:
    """Set PyTorch's determinism and speed switches for this process.

    Call it first in ``main``, before CUDA starts (``init_distributed``): cuBLAS reads its workspace then."""
    fast_cuda = not deterministic and wants_cuda(device_preference)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if torch.are_deterministic_algorithms_enabled() != deterministic:
        # Only when it changes: the setter imports Inductor for its own flag (slow: benchmarks/RESULTS.md,
        # issue 36), which a run that stops on a bad input before its first step would wait for in vain.
        torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = fast_cuda
    # CUDA's matmul switch only (set_float32_matmul_precision would change CPU oneDNN matmuls too),
    # through the legacy setter: it sets the legacy and the new (fp32_precision) state together, so
    # both readers agree. Setting fp32_precision alone makes allow_tf32 and
    # get_float32_matmul_precision() raise "mix of the legacy and new APIs", and Inductor reads them.
    torch.backends.cuda.matmul.allow_tf32 = fast_cuda
