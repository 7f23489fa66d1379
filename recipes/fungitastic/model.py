"""One timm backbone with a linear head per taxonomic level (species, genus, ... phylum).

Pretrained weights come from a local copy (the folder ``make prep-fungitastic`` writes under
``data/weights/``, or a state-dict file), or from a hub name given explicitly, such as
``hf-hub:BVRA/beit_base_patch16_224.in1k_ft_fungitastic_224``. The backbone must match
``model.name``; a pretrained classifier whose size matches the species label space (the
published FungiTastic models use ``category_id`` order, as this recipe does) initialises the
species head.
"""

from __future__ import annotations

import functools
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
from timm.optim import param_groups_layer_decay
from torch import nn

from common.errors import UserError
from common.pytorch.optim import weight_decay_groups
from common.pytorch.weights import missing, read_pretrained_cfg, read_state_dict
from recipes.fungitastic import metadata
from recipes.fungitastic.config import ModelConfig

HUB_PREFIX = "hf-hub:"


class TaxonomyClassifier(nn.Module):
    """``forward(x)`` returns ``{level: logits}``, one entry per configured level."""

    def __init__(self, backbone: nn.Module, num_classes: dict[str, int], levels: list[str], dropout: float) -> None:
        super().__init__()
        self.backbone = backbone
        self.levels = list(levels)
        self.dropout = nn.Dropout(dropout)
        self.heads = nn.ModuleDict({level: nn.Linear(backbone.num_features, num_classes[level]) for level in levels})
        self.pretrained_parts = ""  # what build_model loaded from pretrained weights

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.dropout(self.backbone(images))
        return {level: head(features) for level, head in self.heads.items()}


def size_kwargs(name: str, image_size: int, any_size: bool = False) -> dict[str, int | bool]:
    """``{"img_size": image_size}`` for a timm model built for one input size (a ViT), with
    ``dynamic_img_size`` too when ``any_size`` (``data.progressive``'s epochs) and the model has it;
    ``{}`` for one that takes any size (a convolutional network has no ``img_size`` argument)."""
    if not _takes(name, img_size=image_size):
        return {}
    if any_size and _takes(name, img_size=image_size, dynamic_img_size=True):
        return {"img_size": image_size, "dynamic_img_size": True}
    return {"img_size": image_size}


@functools.cache
def _takes(name: str, **kwargs: int | bool) -> bool:
    """Whether timm builds ``name`` with these arguments. Asked once per name and arguments: building even
    on the meta device initialises every tensor (a tenth of a second for a tiny ViT, seconds for BEiT-B),
    and training, each split's evaluation and the export ask again."""
    try:
        with torch.device("meta"):  # only the arguments are checked: no weights are made
            timm.create_model(name, pretrained=False, num_classes=0, **kwargs)
    except TypeError:
        return False
    return True


def create_backbone(cfg: ModelConfig, image_size: int, any_size: bool = False) -> nn.Module:
    """``cfg.name`` without its classifier, built for ``image_size`` inputs when it takes a size (and for
    any size when ``any_size`` and it can be)."""
    try:
        return timm.create_model(cfg.name, pretrained=False, num_classes=0, drop_path_rate=cfg.drop_path_rate,
                                 **size_kwargs(cfg.name, image_size, any_size))
    except (RuntimeError, ValueError) as error:  # timm's "Unknown model" is a RuntimeError
        raise UserError(f"model.name={cfg.name!r}: {error}") from error


def is_hub_name(source: str) -> bool:
    return source.startswith(HUB_PREFIX) or timm.is_model(source)


def _hub_model(source: str, pretrained: bool) -> nn.Module:
    """A hub model named explicitly (``hf-hub:owner/name`` or a timm pretrained tag), fetched now:
    its weights, or only its config (on the meta device, without ``pretrained``)."""
    try:
        if pretrained:
            return timm.create_model(source, pretrained=True)
        with torch.device("meta"):
            return timm.create_model(source, pretrained=False)
    except Exception as error:  # hub errors come in many types (offline, missing repo, auth)
        raise UserError(f"model.pretrained={source!r} could not be fetched from the hub "
                        f"({str(error).splitlines()[0]}); store a copy with `make prep-fungitastic` where the hub "
                        f"is reachable (or from WEIGHTS=<dir or file>) and point model.pretrained at it") from error


def pretrained_state(source: str) -> dict[str, torch.Tensor]:
    """The state dict of a local copy (the folder `make prep-fungitastic` writes, or a weights
    file), or of a hub model named explicitly."""
    path = Path(source)
    if path.exists():
        return read_state_dict(path)
    if is_hub_name(source):
        return _hub_model(source, pretrained=True).state_dict()
    raise missing("model.pretrained", source, "fungitastic")


def input_normalization(cfg: ModelConfig, image_size: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The mean and std the model's inputs are normalised with: those of its pretrained weights
    (a local copy's timm ``config.json``, a hub model's config), else the architecture's default.
    Read without the weights, so evaluation and export agree with training."""
    pretrained_cfg = None
    if cfg.pretrained and Path(cfg.pretrained).is_dir():
        pretrained_cfg = read_pretrained_cfg(Path(cfg.pretrained))
    elif cfg.pretrained and not Path(cfg.pretrained).exists() and is_hub_name(cfg.pretrained):
        pretrained_cfg = _hub_model(cfg.pretrained, pretrained=False).pretrained_cfg
    if pretrained_cfg is None:
        return _architecture_normalization(cfg.name, image_size)
    return tuple(pretrained_cfg["mean"]), tuple(pretrained_cfg["std"])


@functools.cache
def _architecture_normalization(name: str, image_size: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The mean and std of ``name``'s own pretrained config, from a model on the meta device, once per
    name and size (see :func:`_takes`)."""
    with torch.device("meta"):
        pretrained_cfg = create_backbone(ModelConfig(name=name, pretrained=""), image_size).pretrained_cfg
    return tuple(pretrained_cfg["mean"]), tuple(pretrained_cfg["std"])


def load_pretrained(model: TaxonomyClassifier, source: str) -> str:
    """Load backbone weights (strictly) and, if its size fits, the species head; say what was loaded."""
    state = pretrained_state(source)
    classifier = model.backbone.pretrained_cfg.get("classifier", "head")
    head = {key[len(classifier) + 1 :]: value for key, value in state.items() if key.startswith(f"{classifier}.")}
    backbone = {key: value for key, value in state.items() if not key.startswith(f"{classifier}.")}
    try:
        result = model.backbone.load_state_dict(backbone, strict=False)
    except RuntimeError as error:  # tensors of the wrong shape
        raise UserError(f"model.pretrained={source!r} does not fit {type(model.backbone).__name__}: "
                        f"{str(error).splitlines()[-1].strip()}") from error
    problems = [f"missing {key}" for key in result.missing_keys] + [f"unexpected {k}" for k in result.unexpected_keys]
    if problems:
        raise UserError(f"model.pretrained={source!r} does not fit {type(model.backbone).__name__}: "
                        f"{', '.join(problems[:4])}{', ...' if len(problems) > 4 else ''}")
    species_head = model.heads["species"] if "species" in model.heads else None
    weight = head.get("weight")
    if species_head is not None and weight is not None and weight.shape == species_head.weight.shape:
        species_head.load_state_dict(head)
        return "backbone and species head"
    return "backbone"


def build_model(cfg: ModelConfig, num_classes: dict[str, int], levels: list[str], image_size: int,
                pretrained: bool = True, any_size: bool = False) -> TaxonomyClassifier:
    """The classifier, with the weights of ``cfg.pretrained`` when ``pretrained`` (what was loaded is
    in its ``pretrained_parts``; a checkpoint or an export brings the weights otherwise); ``any_size``:
    :func:`create_backbone`'s."""
    unknown = [level for level in levels if level not in num_classes]
    if unknown:
        raise UserError(f"data.levels has {unknown}; taxonomic_mappings.json has {sorted(num_classes)}")
    model = TaxonomyClassifier(create_backbone(cfg, image_size, any_size), num_classes, levels, cfg.head_dropout)
    if pretrained and cfg.pretrained:
        model.pretrained_parts = load_pretrained(model, cfg.pretrained)
    return model


def layer_decay_groups(model: TaxonomyClassifier, lr: float, weight_decay: float, layer_decay: float) -> list[dict]:
    """AdamW groups with no weight decay on norms and biases. With ``layer_decay`` in (0, 1) the
    backbone's layer ``i`` of ``L`` learns at ``lr * layer_decay^(L-i)`` (BEiT's fine-tuning rule,
    through timm; its ``no_weight_decay()`` parameters such as position embeddings get none), the
    heads at ``lr``."""
    if not layer_decay:
        groups = weight_decay_groups(model, weight_decay)
        for group in groups:
            group["lr"] = lr
        return groups
    skip = model.backbone.no_weight_decay() if hasattr(model.backbone, "no_weight_decay") else set()
    groups = param_groups_layer_decay(model.backbone, weight_decay, skip, layer_decay=layer_decay)
    for group in groups:
        group["lr"] = lr * group.pop("lr_scale")
    for group in weight_decay_groups(model.heads, weight_decay):
        group["lr"] = lr
        groups.append(group)
    return groups


class MultiTaskLoss:
    """Sum over levels of ``weight[level] * cross-entropy`` (a level without a weight weighs 1);
    labels of -1 are ignored."""

    def __init__(self, levels: list[str], level_weights: dict[str, float], class_weights: dict[str, torch.Tensor],
                 label_smoothing: float) -> None:
        self.levels = levels
        self.level_weights = {level: float(level_weights.get(level, 1.0)) for level in levels}
        self.class_weights = class_weights
        self.label_smoothing = label_smoothing

    def __call__(self, outputs: dict[str, torch.Tensor], labels: torch.Tensor, training: bool = True) -> torch.Tensor:
        """Training: the weighted sum of per-level means (class weights, smoothing). Evaluation:
        the plain per-sample sum, so that a split's loss is exact however it is batched."""
        total = torch.zeros((), device=labels.device)
        for column, level in enumerate(self.levels):
            target = labels[:, column]
            if training:
                loss = F.cross_entropy(outputs[level].float(), target, weight=self.class_weights.get(level),
                                       ignore_index=metadata.UNKNOWN, label_smoothing=self.label_smoothing)
                # A micro-batch with no label at this level adds nothing (its mean is 0/0); a NaN from a
                # diverging model is kept, for trainer.nonfinite to see.
                loss = torch.where((target != metadata.UNKNOWN).any(), loss, 0.0)
            else:
                loss = F.cross_entropy(outputs[level].float(), target, ignore_index=metadata.UNKNOWN, reduction="sum")
            total = total + self.level_weights[level] * loss
        return total
