"""A DINOv2 backbone (transformers or timm) with a linear head, and FSDP2's stage switch.

The backbone comes from transformers' ``Dinov2Model`` (default) or timm's
``vit_*_patch14_dinov2``. Both expose the same three things the recipe needs: the final
normalised tokens, the list of transformer blocks (the FSDP units) and the embedding width.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.errors import UserError
from common.pytorch.weights import missing, weights_file
from recipes.dinov2_fsdp.config import Features, Library, ModelConfig

NUM_CLASSES = 100

# The published facebook/dinov2-* architectures, so they can be built without the hub (benchmarks,
# random initialisation on an offline node). Everything else is Dinov2Config's default (patch 14).
DINOV2_ARCHITECTURES = {
    "facebook/dinov2-small": {"hidden_size": 384, "num_hidden_layers": 12, "num_attention_heads": 6},
    "facebook/dinov2-base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12},
    "facebook/dinov2-large": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16},
    "facebook/dinov2-giant": {"hidden_size": 1536, "num_hidden_layers": 40, "num_attention_heads": 24,
                              "use_swiglu_ffn": True},
}
# Parameters that never receive a gradient in classification (transformers' masked-image token):
# kept frozen in every stage so the optimizer state has the same keys whenever it is saved.
NEVER_TRAINED = ("backbone.embeddings.mask_token",)


class DinoClassifier(nn.Module):
    """Backbone features (CLS token, optionally with the mean patch token) into a linear head."""

    def __init__(self, backbone: nn.Module, library: Library, features: Features) -> None:
        super().__init__()
        self.backbone = backbone
        self.library = Library(library)
        self.features = Features(features)
        if self.library == Library.transformers:
            self.embed_dim = backbone.config.hidden_size
            self.num_prefix_tokens = 1
        else:
            self.embed_dim = backbone.embed_dim
            self.num_prefix_tokens = backbone.num_prefix_tokens
        width = self.embed_dim * (2 if self.features == Features.cls_patch_mean else 1)
        self.head = nn.Linear(width, NUM_CLASSES)
        nn.init.trunc_normal_(self.head.weight, std=0.01)
        nn.init.zeros_(self.head.bias)

    @property
    def blocks(self) -> nn.ModuleList:
        """The transformer blocks: each one is an FSDP unit and a torch.compile unit."""
        if self.library == Library.transformers:
            return self.backbone.encoder.layer
        return self.backbone.blocks

    def set_backbone_trainable(self, trainable: bool) -> None:
        for name, param in self.named_parameters():
            if name.startswith("backbone."):
                param.requires_grad_(trainable and name not in NEVER_TRAINED)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.library == Library.transformers:
            tokens = self.backbone(pixel_values=images).last_hidden_state
        else:
            tokens = self.backbone.forward_features(images)
        features = tokens[:, 0]
        if self.features == Features.cls_patch_mean:
            features = torch.cat([features, tokens[:, self.num_prefix_tokens :].mean(dim=1)], dim=-1)
        return self.head(features)


def _local_weights(cfg: ModelConfig) -> Path | None:
    """The local copy of the pretrained weights; None when they come from the hub (``model.weights=""``)."""
    if not cfg.pretrained or not cfg.weights:
        return None
    if not Path(cfg.weights).exists():
        raise missing("model.weights", cfg.weights, "dinov2_fsdp")
    return Path(cfg.weights)


def _unreachable(cfg: ModelConfig, error: Exception) -> UserError:
    return UserError(f"cannot load the DINOv2 model {cfg.name!r} ({str(error).splitlines()[0]}); store its weights "
                     f"with `make prep-dinov2_fsdp` where the hub is reachable (or from WEIGHTS=<dir or file>) and set "
                     f"model.weights to the copy")


def transformers_config(cfg: ModelConfig) -> Any:
    """The backbone's ``Dinov2Config``: that of the pretrained weights (the local copy, else the hub),
    or, for a random initialisation, of the published architecture table or the hub."""
    from transformers import Dinov2Config

    weights = _local_weights(cfg)
    try:
        if cfg.pretrained:
            config = Dinov2Config.from_pretrained(str(weights or cfg.name))
        elif cfg.name in DINOV2_ARCHITECTURES:
            config = Dinov2Config(**DINOV2_ARCHITECTURES[cfg.name])
        else:
            config = Dinov2Config.from_pretrained(cfg.name)
    except OSError as error:
        raise _unreachable(cfg, error) from error
    config.image_size = cfg.image_size  # the position table is built for (or resampled to) the training size
    return config


def _transformers_backbone(cfg: ModelConfig, pretrained: bool) -> nn.Module:
    from transformers import Dinov2Model

    weights = _local_weights(cfg)
    if pretrained and cfg.pretrained:
        try:
            return Dinov2Model.from_pretrained(str(weights or cfg.name), attn_implementation="sdpa")
        except OSError as error:
            raise _unreachable(cfg, error) from error
    config = transformers_config(cfg)
    config._attn_implementation = "sdpa"
    return Dinov2Model(config)


def fit_position_table(backbone: nn.Module, image_size: int) -> None:
    """Resample a transformers DINOv2's position-embedding table to ``image_size`` once, as timm
    does for ``img_size``.

    A table made for another size (the published weights': 518 px) is interpolated bicubically in
    every forward; once the backbone trains, that interpolation's backward has no deterministic
    CUDA kernel, and ``trainer.deterministic=true`` fails at the first fine-tune step (it also
    costs a resampling per forward). transformers' own interpolation makes the new table, so the
    model computes what it computed with the old one.
    """
    embeddings = backbone.embeddings
    table = embeddings.position_embeddings
    positions = (image_size // backbone.config.patch_size) ** 2 + 1  # the patches and the CLS token
    if table.shape[1] != positions:
        tokens = torch.empty(1, positions, table.shape[-1], device="meta")  # only its shape is read
        with torch.no_grad():
            resized = embeddings.interpolate_pos_encoding(tokens, image_size, image_size)
        embeddings.position_embeddings = nn.Parameter(resized.contiguous())
    backbone.config.image_size = image_size


def _timm_backbone(cfg: ModelConfig, pretrained: bool) -> nn.Module:
    import timm

    load = pretrained and cfg.pretrained
    weights = _local_weights(cfg) if load else None
    overlay = {"file": str(weights_file(weights).resolve())} if weights is not None else None
    try:
        return timm.create_model(cfg.name, pretrained=load, num_classes=0, img_size=cfg.image_size,
                                 pretrained_cfg_overlay=overlay)
    except Exception as error:
        if load and weights is None:  # fetched from the hub: offline, missing repository, auth
            raise _unreachable(cfg, error) from error
        # an unknown model name (RuntimeError; ValueError for a name that looks like a hub id in newer
        # timm), or weights that do not fit the architecture
        if isinstance(error, (RuntimeError, ValueError)):
            raise UserError(f"cannot build timm model {cfg.name!r}: {str(error).splitlines()[0]}") from error
        raise


def build_model(cfg: ModelConfig, pretrained: bool = True) -> DinoClassifier:
    """The classifier on CPU in fp32, its backbone the architecture of ``cfg.name`` (of its pretrained
    copy with ``cfg.pretrained``), with those weights when ``pretrained`` (a checkpoint or an export
    brings the weights otherwise)."""
    backbone = (_transformers_backbone(cfg, pretrained) if cfg.library == Library.transformers
                else _timm_backbone(cfg, pretrained))
    patch = backbone.config.patch_size if cfg.library == Library.transformers else backbone.patch_embed.patch_size[0]
    if cfg.image_size % patch:
        raise UserError(f"model.image_size={cfg.image_size} is not a multiple of the patch size {patch}")
    if cfg.library == Library.transformers:
        fit_position_table(backbone, cfg.image_size)  # timm's create_model did it for img_size
    return DinoClassifier(backbone, cfg.library, cfg.features)


def refresh_mixed_precision(model: DinoClassifier) -> None:
    """Make every FSDP2 unit derive its mixed-precision dtypes from the parameters trainable now.

    FSDP2 fixes a unit's gradient dtypes from its trainable parameters when the unit first runs,
    which is during the probe, when the backbone's blocks have none: torch 2.14 then falls back
    to all parameters, earlier releases leave the dtypes unset, and the first fine-tune backward
    fails ("attempting to assign a gradient with dtype BFloat16 to a tensor with dtype float")
    or reduces in the wrong dtype. ``unshard()`` (public API) re-runs that set-up in every
    release, so calling it after unfreezing makes the switch independent of the fallback.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.unshard()
            module.reshard()
