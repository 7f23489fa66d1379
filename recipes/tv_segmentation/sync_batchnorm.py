"""Batch normalization with statistics over the global batch, on any backend.

:class:`AllReduceBatchNorm` computes the statistics with a differentiable ``all_reduce`` of
per-channel sums: the forward pass normalizes with the mean and variance of the whole global
batch, and the backward pass sums the gradients of those statistics over ranks, as
``torch.nn.SyncBatchNorm`` does. It is used on every device. ``nn.SyncBatchNorm`` refuses CPU
tensors (so it cannot run, or be tested, with gloo), and on CUDA its forward selects the ranks'
non-empty counts with a boolean mask, a host sync in every BatchNorm layer of every forward
(dozens per step for a DeepLabV3). This module has none: one all-reduce per layer, queued on
the stream. It keeps BatchNorm's state-dict keys, so checkpoints move freely between the two.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class AllReduceBatchNorm(_BatchNorm):
    collective_in_forward = True  # every rank must run its forwards alike (common/run/out_of_memory.py)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2-d input, got {input.dim()}-d")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        if not (self.training and distributed):
            return super().forward(input)
        channels = input.shape[1]
        reduce_dims = [0, *range(2, input.dim())]
        local = torch.cat([
            input.sum(reduce_dims, dtype=torch.float64),
            (input * input).sum(reduce_dims, dtype=torch.float64),
            input.new_full((1,), input.numel() // channels, dtype=torch.float64),
        ])
        total = dist_fn.all_reduce(local)  # its backward all-reduces the gradients
        count = total[-1]
        mean = total[:channels] / count
        var = (total[channels : 2 * channels] / count - mean * mean).clamp_min(0)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), count.detach())
        shape = (1, channels) + (1,) * (input.dim() - 2)
        scale = torch.rsqrt(var + self.eps).to(input.dtype).reshape(shape)
        output = (input - mean.to(input.dtype).reshape(shape)) * scale
        if self.affine:
            output = output * self.weight.reshape(shape) + self.bias.reshape(shape)
        return output

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor) -> None:
        self.num_batches_tracked += 1
        momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * count / (count - 1).clamp_min(1)
        self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)


def _replace_batchnorm(module: nn.Module) -> tuple[nn.Module, int]:
    if isinstance(module, _BatchNorm) and not isinstance(module, (AllReduceBatchNorm, nn.SyncBatchNorm)):
        synced = AllReduceBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                    module.track_running_stats)
        synced.load_state_dict(module.state_dict())
        synced.train(module.training)
        return synced, 1
    converted = 0
    for name, child in module.named_children():
        replacement, count = _replace_batchnorm(child)
        converted += count
        if replacement is not child:
            setattr(module, name, replacement)
    return module, converted


def convert_sync_batchnorm(model: nn.Module) -> tuple[nn.Module, int]:
    """``model`` with every BatchNorm synchronised across ranks, and how many were converted."""
    return _replace_batchnorm(model)
