"""torchvision segmentation models by name, with weights from a local file or a torchvision name.

A weights value is either a path to a state-dict file (``torch.save`` of a state dict, or of
a checkpoint with a ``"model"`` entry) or a torchvision weights name such as
``MobileNet_V3_Large_Weights.IMAGENET1K_V1``, which torchvision downloads to its cache.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torchvision
from torch import nn
from torch.overrides import TorchFunctionMode

from common.errors import UserError
from recipes.tv_segmentation.coco import IGNORE_INDEX
from recipes.tv_segmentation.config import ModelConfig


def available_models() -> list[str]:
    return torchvision.models.list_models(module=torchvision.models.segmentation)


def _is_local(weights: str) -> bool:
    return Path(weights).is_file() or "/" in weights or weights.endswith((".pt", ".pth"))


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    if not Path(path).is_file():
        raise UserError(f"weights file {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a pickle that is not a plain state dict, or a damaged file
        raise UserError(f"{path} is not a readable state dict ({str(error).splitlines()[0]})") from error
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path} does not hold a state dict of tensors")
    return state


def load_backbone(backbone: nn.Module, path: str) -> int:
    """Load a classification network's weights into a segmentation backbone; return the count.

    Backbone keys are the classifier's (ResNet) or its ``features.`` keys (MobileNetV3); the
    classifier's head is not used. Every backbone tensor must be found with the same shape.
    """
    source = read_state_dict(path)
    target = backbone.state_dict()
    loaded = {}
    for key, tensor in target.items():
        match = source.get(key, source.get(f"features.{key}"))
        if match is None or match.shape != tensor.shape:
            raise UserError(f"{path} does not fit the backbone: {key} {tuple(tensor.shape)} is "
                            f"{'missing' if match is None else f'{tuple(match.shape)} there'}")
        loaded[key] = match
    backbone.load_state_dict(loaded)
    return len(loaded)


def build_model(cfg: ModelConfig, pretrained: bool = True) -> nn.Module:
    """``cfg.name`` from torchvision, with ``cfg.weights`` and ``cfg.weights_backbone`` when
    ``pretrained`` (a checkpoint or an export brings the weights otherwise)."""
    if cfg.name not in available_models():
        raise UserError(f"model.name={cfg.name} is not a torchvision segmentation model; "
                        f"choose one of {', '.join(available_models())}")
    weights, weights_backbone = (cfg.weights, cfg.weights_backbone) if pretrained else ("", "")
    hub_weights = weights if weights and not _is_local(weights) else None
    hub_backbone = weights_backbone if weights_backbone and not _is_local(weights_backbone) else None
    options = {"aux_loss": True} if cfg.aux_loss else {}
    try:
        model = torchvision.models.get_model(cfg.name, weights=hub_weights, weights_backbone=hub_backbone,
                                             num_classes=cfg.num_classes, **options)
    except (KeyError, ValueError, NotImplementedError) as error:
        raise UserError(f"cannot build {cfg.name} with weights={cfg.weights!r}, "
                        f"weights_backbone={cfg.weights_backbone!r}: {error}") from error
    if weights_backbone and hub_backbone is None:
        load_backbone(model.backbone, weights_backbone)
    if weights and hub_weights is None:
        try:
            model.load_state_dict(read_state_dict(weights))
        except RuntimeError as error:
            raise UserError(f"{weights} does not fit {cfg.name}: {str(error).splitlines()[1].strip()}") from error
    return model


def head_lr_groups(model: nn.Module, aux_lr: float) -> list[dict]:
    """torchvision's groups: backbone and main head at the base LR, auxiliary head at 10x;
    weight decay on every parameter, as the reference does."""
    unwrapped = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    groups = [{"params": [p for p in unwrapped.backbone.parameters() if p.requires_grad]},
              {"params": [p for p in unwrapped.classifier.parameters() if p.requires_grad]}]
    aux = getattr(unwrapped, "aux_classifier", None)
    if aux is not None:
        groups.append({"params": [p for p in aux.parameters() if p.requires_grad],
                       "lr": aux_lr})
    return groups


def warmup_poly(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, power: float,
                start_factor: float) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup from ``start_factor``, then ``(1 - t)^power`` decay to 0 (torchvision's
    LinearLR + PolynomialLR), as a per-step LambdaLR whose state is just the step count."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return start_factor + (1 - start_factor) * step / warmup_steps
        decay_steps = max(1, total_steps - warmup_steps)
        return (1 - min(step - warmup_steps, decay_steps) / decay_steps) ** power

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def pixel_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over the pixels not labelled 255, as per-pixel losses summed: CUDA's
    reduced 2-d ``nll_loss`` accumulates with atomics and has no deterministic version."""
    per_pixel = nn.functional.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="none")
    return per_pixel.sum() / (target != IGNORE_INDEX).sum()


def segmentation_loss(outputs: dict[str, torch.Tensor], target: torch.Tensor, aux_weight: float) -> torch.Tensor:
    """Cross entropy ignoring 255, plus ``aux_weight`` x the auxiliary head's."""
    loss = pixel_cross_entropy(outputs["out"], target)
    if "aux" in outputs:
        loss = loss + aux_weight * pixel_cross_entropy(outputs["aux"], target)
    return loss


def bilinear_weights(in_size: int, out_size: int, device: torch.device) -> torch.Tensor:
    """``[out_size, in_size]`` weights of bilinear resizing along one axis, as ``F.interpolate``
    (``align_corners=False``) computes them, made on the device (no copy from the host)."""
    source = ((torch.arange(out_size, device=device) + 0.5) * (in_size / out_size) - 0.5).clamp(min=0)
    low = source.floor().long().clamp(max=in_size - 1)
    high = (low + 1).clamp(max=in_size - 1)
    fraction = (source - low)[:, None]
    columns = torch.arange(in_size, device=device)
    return (1 - fraction) * (columns == low[:, None]) + fraction * (columns == high[:, None])


def resize_bilinear(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``F.interpolate(images, size, mode="bilinear", align_corners=False)`` as two matrix products."""
    rows = bilinear_weights(images.shape[-2], size[0], images.device)
    columns = bilinear_weights(images.shape[-1], size[1], images.device)
    return rows @ images @ columns.T


class DeterministicBilinear(TorchFunctionMode):
    """Inside it, bilinear ``F.interpolate`` calls (the torchvision models' upsampling) run as
    :func:`resize_bilinear`. Their backward is then two matrix products, deterministic on CUDA,
    where PyTorch's own bilinear backward accumulates with atomics and, under
    ``torch.use_deterministic_algorithms``, refuses to run."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (PyTorch's protocol)
        kwargs = kwargs or {}
        if (func is nn.functional.interpolate and kwargs.get("mode") == "bilinear" and not kwargs.get("align_corners")
                and kwargs.get("size") is not None and not kwargs.get("antialias")):
            return resize_bilinear(args[0], tuple(kwargs["size"]))
        return func(*args, **kwargs)


def training_resize(device: torch.device, deterministic: bool) -> contextlib.AbstractContextManager:
    """:class:`DeterministicBilinear` where it is needed (CUDA with ``trainer.deterministic``)."""
    return DeterministicBilinear() if deterministic and device.type == "cuda" else contextlib.nullcontext()

