"""``trainer.activation_checkpointing``: trade compute for memory by recomputing activations in the backward pass.

Every recipe calls :func:`checkpoint_blocks` on its model (tv_segmentation on its backbone) before
FSDP2, DDP and ``torch.compile`` wrap it. The unit is a *block*, a model's repeated residual unit
(transformer layer, ResNet bottleneck, EfficientNet or MobileNet block), as timm and torchtitan use.

- ``blocks``: each block keeps only its input and recomputes the rest in the backward pass (about one
  more forward per step, the most memory saved).
- ``selective`` (transformer blocks only): keeps the outputs of matrix products and attention and
  recomputes the cheap operators, as torchtitan's per-operator policy does. Refused for convolutional
  blocks: their convolutions' outputs are often changed in place, which a kept output cannot be.
- Forwards are replaced in place: parameter names, checkpoints and exports are unchanged, and a
  ``copy.deepcopy`` (an EMA) computes with its own weights.
- Gradients and buffers equal a run without it: the recomputation draws the same random numbers, and
  BatchNorm does not update its running statistics twice (eagerly; a compiled graph updates them once).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from common.config import ActivationCheckpointing
from common.errors import UserError

aten = torch.ops.aten


# The operators whose outputs ``selective`` keeps: those that cost the FLOPs.
_KEPT_BY_SELECTIVE = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
}
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def residual_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks, outermost first: multi-layer modules held in its containers.

    - Containers: ``Sequential``, ``ModuleList``, ``ModuleDict``, nested ones walked through.
    - A single layer in a container (a stem's convolution) is not a block.
    """
    found: list[nn.Module] = []

    def walk(module: nn.Module) -> None:
        in_container = isinstance(module, _CONTAINERS)
        for child in module.children():
            if in_container and not isinstance(child, _CONTAINERS) and next(child.children(), None) is not None:
                found.append(child)
            else:
                walk(child)

    walk(model)
    return found


def _is_transformer_block(block: nn.Module) -> bool:
    """A block built on matrix products (linear layers) rather than convolutions."""
    return any(isinstance(module, nn.Linear) for module in block.modules()) and not any(
        isinstance(module, nn.modules.conv._ConvNd) for module in block.modules())


def _kept_or_recomputed(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEPT_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


@contextlib.contextmanager
def _running_statistics_frozen(block: nn.Module) -> Iterator[None]:
    """While a block is recomputed, its BatchNorm layers leave their running statistics and counts alone."""
    norms = [module for module in block.modules() if isinstance(module, _BatchNorm) and module.track_running_stats]
    kept = [(norm.momentum, norm.num_batches_tracked.clone()) for norm in norms]
    for norm in norms:
        norm.momentum = 0.0
    try:
        yield
    finally:  # the recomputation may stop early, before some of them ran: their counts are put back as they were
        for norm, (momentum, count) in zip(norms, kept):
            norm.momentum = momentum
            norm.num_batches_tracked.copy_(count)


@contextlib.contextmanager
def _recomputing(block: nn.Module, recompute: contextlib.AbstractContextManager) -> Iterator[None]:
    with _running_statistics_frozen(block), recompute:  # the recomputation's own mode ends first
        yield


def _contexts(block: nn.Module, selective: bool) -> tuple[contextlib.AbstractContextManager, Any]:
    """``torch.utils.checkpoint``'s ``context_fn`` for ``block``: the forward's and the recomputation's contexts."""
    forward, recompute = (create_selective_checkpoint_contexts(_kept_or_recomputed) if selective
                          else (contextlib.nullcontext(), contextlib.nullcontext()))
    return forward, _recomputing(block, recompute)


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A block's forward with recomputed activations; bound to the block, so a deep copy binds it to the copy."""
    forward = type(self).forward.__get__(self)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    selective = self._activation_checkpointing == ActivationCheckpointing.selective
    if torch.compiler.is_compiling():  # the compiler recomputes in its own graph and updates buffers once
        context_fn = (functools.partial(create_selective_checkpoint_contexts, _kept_or_recomputed) if selective
                      else None)
        options = {"context_fn": context_fn} if context_fn else {}
        return checkpoint(forward, *args, use_reentrant=False, **options, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=functools.partial(_contexts, self, selective),
                      **kwargs)


def checkpoint_blocks(model: nn.Module, mode: ActivationCheckpointing | str, what: str = "the model") -> int:
    """Recompute the activations of ``model``'s blocks (:func:`residual_blocks`) in the backward pass.

    - ``mode``: ``none``, ``blocks`` or ``selective``. Returns the number of blocks checkpointed.
    - Raises ``UserError`` (naming ``what``) for a model without blocks, or ``selective`` on convolutional ones.
    """
    mode = ActivationCheckpointing(mode)
    if mode == ActivationCheckpointing.none:
        return 0
    blocks = residual_blocks(model)
    if not blocks:
        raise UserError(f"trainer.activation_checkpointing={mode.value}: {what} ({type(model).__name__}) has no "
                        f"blocks to checkpoint (modules of several layers in a Sequential, ModuleList or ModuleDict)")
    if mode == ActivationCheckpointing.selective and not all(_is_transformer_block(block) for block in blocks):
        raise UserError(f"trainer.activation_checkpointing=selective keeps the matrix products of transformer blocks, "
                        f"and the blocks of {what} ({type(blocks[0]).__name__}) are convolutional: use blocks")
    for block in blocks:
        block._activation_checkpointing = mode
        block.forward = types.MethodType(_checkpointed_forward, block)
    return len(blocks)
