"""A DINOv2 backbone (transformers or timm) with a linear head, and FSDP2's stage switch.

The backbone comes from transformers' ``Dinov2Model`` (default) or timm's
``vit_*_patch14_dinov2``. Both expose the same three things the recipe needs: the final
normalised tokens, the list of transformer blocks (the FSDP units) and the embedding width.
"""

from __future__ import annotations

from dataclasses import dataclass
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


def class_tokens(features: Features) -> int:
    """How many of the last blocks' class tokens ``features`` holds (DINOv2's ``n_last_blocks``)."""
    return 4 if features in (Features.cls4, Features.cls4_patch_mean) else 1


def has_patch_mean(features: Features) -> bool:
    """Whether ``features`` ends with the last block's mean patch token (DINOv2's ``avgpool``)."""
    return features in (Features.cls_patch_mean, Features.cls4_patch_mean)


def narrower_features(features: Features) -> list[Features]:
    """``features`` and every part of it a head can read alone, in DINOv2's order: 1 block then 4,
    each without then with the mean patch token."""
    return [part for part in Features if class_tokens(part) in (1, class_tokens(features))
            and (has_patch_mean(features) or not has_patch_mean(part))]


def feature_columns(features: Features, part: Features, width: int) -> slice:
    """Where ``part``'s features lie in the vector of ``features`` (class tokens oldest block first,
    then the mean patch token), ``width`` the embedding width: always one contiguous run."""
    start = (class_tokens(features) - class_tokens(part)) * width
    return slice(start, class_tokens(features) * width + (width if has_patch_mean(part) else 0))


def feature_width(features: Features, width: int) -> int:
    return (class_tokens(features) + has_patch_mean(features)) * width


def linear_head(width: int) -> nn.Linear:
    """A linear classifier initialised as DINOv2's eval/linear.py does (weights N(0, 0.01), bias 0)."""
    head = nn.Linear(width, NUM_CLASSES)
    nn.init.trunc_normal_(head.weight, std=0.01)
    nn.init.zeros_(head.bias)
    return head


@dataclass(frozen=True)
class ProbeHead:
    """One head of the linear probe: its LR (before batch scaling) and the features it reads."""

    lr: float
    features: Features

    @property
    def name(self) -> str:
        return f"{self.features.value}_lr{self.lr:g}"


class ProbeHeads(nn.Module):
    """The probe's heads, trained at once on one feature vector (DINOv2's ``AllClassifiers``): each
    reads its columns of ``features``' vector; the output is ``[heads, batch, classes]``."""

    def __init__(self, heads: list[ProbeHead], features: Features, width: int) -> None:
        super().__init__()
        self.columns = [feature_columns(features, head.features, width) for head in heads]
        self.heads = nn.ModuleList(linear_head(columns.stop - columns.start) for columns in self.columns)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.stack([head(features[:, columns]) for head, columns in zip(self.heads, self.columns)])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 parameter (all its rows split alike), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class DinoClassifier(nn.Module):
    """Backbone features (``model.features``) into a linear head; with ``probe_heads`` (a sweep of
    several), those heads too, which the probe trains instead of ``head`` and hands the best of."""

    def __init__(self, backbone: nn.Module, library: Library, features: Features,
                 probe_heads: list[ProbeHead] | tuple[ProbeHead, ...] = ()) -> None:
        super().__init__()
        self.backbone = backbone
        self.library = Library(library)
        self.features = Features(features)
        if self.library == Library.transformers:
            self.embed_dim = backbone.config.hidden_size
            self.num_prefix_tokens = 1
            depth = backbone.config.num_hidden_layers
        else:
            self.embed_dim = backbone.embed_dim
            self.num_prefix_tokens = backbone.num_prefix_tokens
            depth = len(backbone.blocks)
        if class_tokens(self.features) > depth:
            raise UserError(f"model.features={self.features.value} reads the class tokens of the last "
                            f"{class_tokens(self.features)} blocks, and this backbone has {depth}")
        self.head = linear_head(feature_width(self.features, self.embed_dim))
        self.probe_heads = ProbeHeads(list(probe_heads), self.features, self.embed_dim) if probe_heads else None
        self.probing = False  # forward gives the probe heads' logits, [heads, batch, classes]

    @property
    def blocks(self) -> nn.ModuleList:
        """The transformer blocks: each one is an FSDP unit and a torch.compile unit."""
        if self.library == Library.transformers:
            return self.backbone.encoder.layer
        return self.backbone.blocks

    def set_backbone_trainable(self, trainable: bool) -> None:
        """Fine-tune (``trainable``) or probe; with probe heads, the probe trains them and not ``head``."""
        for name, param in self.named_parameters():
            if name.startswith("backbone."):
                param.requires_grad_(trainable and name not in NEVER_TRAINED)
        if self.probe_heads is not None:
            self.probe_heads.requires_grad_(not trainable)
            self.head.requires_grad_(trainable)
            self.probing = not trainable

    @torch.no_grad()
    def take_probe_head(self, index: int) -> None:
        """End the probe: ``head`` becomes probe head ``index`` (zero weight on the features that head
        did not read, so it computes the same logits), and the forward reads ``head`` again."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(self, FSDPModule):  # before torch 2.14 an evaluation leaves the root's weights gathered
            self.reshard()
        source, columns = self.probe_heads.heads[index], self.probe_heads.columns[index]
        weight = _local(self.head.weight)
        weight.zero_()
        weight[:, columns].copy_(_local(source.weight))
        _local(self.head.bias).copy_(_local(source.bias))
        self.probing = False

    def head_input(self, images: torch.Tensor) -> torch.Tensor:
        """The features the heads read, from one forward of the backbone: the class tokens of the
        last 1 or 4 blocks (each normalised), then the last block's mean patch token."""
        blocks = class_tokens(self.features)
        if self.library == Library.transformers:
            output = self.backbone(pixel_values=images, output_hidden_states=blocks > 1)
            tokens = output.last_hidden_state
            earlier = output.hidden_states[-blocks:-1] if blocks > 1 else ()  # before the final norm
            classes = [*(self.backbone.layernorm(hidden[:, 0]) for hidden in earlier), tokens[:, 0]]
            patches = tokens[:, self.num_prefix_tokens :]
        elif blocks > 1:
            layers = self.backbone.forward_intermediates(images, indices=blocks, norm=True, return_prefix_tokens=True,
                                                         output_fmt="NLC", intermediates_only=True)
            classes, patches = [prefix[:, 0] for _, prefix in layers], layers[-1][0]
        else:
            tokens = self.backbone.forward_features(images)
            classes, patches = [tokens[:, 0]], tokens[:, self.num_prefix_tokens :]
        parts = [*classes, patches.mean(dim=1)] if has_patch_mean(self.features) else classes
        return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.head_input(images)
        return self.probe_heads(features) if self.probing else self.head(features)


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


def build_model(cfg: ModelConfig, pretrained: bool = True,
                probe_heads: list[ProbeHead] | tuple[ProbeHead, ...] = ()) -> DinoClassifier:
    """The classifier on CPU in fp32, its backbone the architecture of ``cfg.name`` (of its pretrained
    copy with ``cfg.pretrained``), with those weights when ``pretrained`` (a checkpoint or an export
    brings the weights otherwise); ``probe_heads``: the probe's sweep, when it has several heads."""
    backbone = (_transformers_backbone(cfg, pretrained) if cfg.library == Library.transformers
                else _timm_backbone(cfg, pretrained))
    patch = backbone.config.patch_size if cfg.library == Library.transformers else backbone.patch_embed.patch_size[0]
    if cfg.image_size % patch:
        raise UserError(f"model.image_size={cfg.image_size} is not a multiple of the patch size {patch}")
    if cfg.library == Library.transformers:
        fit_position_table(backbone, cfg.image_size)  # timm's create_model did it for img_size
    return DinoClassifier(backbone, cfg.library, cfg.features, probe_heads)


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
