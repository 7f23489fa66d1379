"""dinov2_fsdp as the shared tools see it (``common/recipes.py``): ``make eval``, ``make export``
and ``init_from=`` read this alone. ``train.py`` imports the model as trained, the splits and
the evaluation from here (this module imports nothing of it), so training and the tools share them.

The FSDP shards are consolidated into one ``model.safetensors``. With transformers (the default)
its names are those of ``Dinov2ForImageClassification`` (``dinov2.*`` and ``classifier.*``) and
the folder has that backbone's ``config.json`` (with CIFAR-100's labels), so
``Dinov2Model.from_pretrained(folder)`` loads the backbone, and with ``model.features=cls_patch_mean``
(the head that class has) ``Dinov2ForImageClassification.from_pretrained(folder)`` loads the whole
classifier. With timm the names are timm's, and with ``model.features=cls`` (timm's token pooling)
timm loads the whole classifier (the ``timm`` entry of ``metadata.json``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.after_training.evaluate import metric_prefix, model_outputs
from common.after_training.export import timm_loading
from common.data import cifar100
from common.data.encoded import FixedSizeImage
from common.data.image_batches import Normalize
from common.data.sampler import ResumableDistributedSampler
from common.errors import UserError
from common.pytorch.activation_checkpointing import checkpoint_blocks
from common.pytorch.distributed import DistInfo, on_device
from common.pytorch.fsdp import fully_shard_blocks, process_group_options
from common.pytorch.metrics import SumMetrics, add_classification, classification_metrics
from common.recipes import Evaluate, PredictInput, RecipeSpec, one_classifier
from recipes.dinov2_fsdp.config import DinoV2FSDPConfig, ModelConfig
from recipes.dinov2_fsdp.data import MEAN, STD, to_model_input
from recipes.dinov2_fsdp.model import (
    NUM_CLASSES,
    DinoClassifier,
    ProbeHead,
    build_model,
    narrower_features,
    transformers_config,
)

SPLITS = ("test",)  # CIFAR-100 has a train and a test split; training evaluates on test


def check_settings(cfg: DinoV2FSDPConfig, dist_info: DistInfo) -> None:
    """Settings this recipe cannot honour, refused before any work."""
    if not 0 <= cfg.stages.probe_epochs <= cfg.trainer.epochs:
        raise UserError(f"stages.probe_epochs={cfg.stages.probe_epochs} must be between 0 and "
                        f"trainer.epochs={cfg.trainer.epochs}")
    if cfg.trainer.precision == "fp16":
        raise UserError("trainer.precision=fp16 is not supported here: use bf16 (no loss scaling needed) or fp32")
    if cfg.fsdp.cpu_offload and dist_info.device.type != "cuda":
        raise UserError("fsdp.cpu_offload moves GPU state to host memory: it needs device=cuda")
    lrs = list(cfg.probe.lrs)
    if any(lr <= 0 for lr in lrs) or len({f"{lr:g}" for lr in lrs}) < len(lrs):  # as heads are named
        raise UserError(f"probe.lrs={lrs} must be distinct LRs above 0, one per head")
    if cfg.stages.probe_epochs == 0 and len(probe_heads(cfg)) > 1:
        raise UserError("probe.lrs and probe.feature_variants sweep the probe's heads, and stages.probe_epochs=0 has "
                        "no probe: set stages.probe_epochs to 1 or more, or leave the sweep out")
    if cfg.probe.feature_variants and cfg.model.features == "cls":
        raise UserError("probe.feature_variants=true trains a head on each part of model.features, and model.features"
                        "=cls has one: set model.features=cls_patch_mean, cls4 or cls4_patch_mean (DINOv2's sweep)")


def probe_heads(cfg: DinoV2FSDPConfig) -> list[ProbeHead]:
    """The linear probe's heads, in DINOv2's order (features, then LR): one per LR of ``probe.lrs``
    (``optim.lr`` alone when empty) and, with ``probe.feature_variants``, per part of ``model.features``."""
    features = narrower_features(cfg.model.features) if cfg.probe.feature_variants else [cfg.model.features]
    return [ProbeHead(lr, part) for part in features for lr in (cfg.probe.lrs or [cfg.optim.lr])]


def swept_heads(cfg: DinoV2FSDPConfig) -> list[ProbeHead]:
    """The heads the model holds beside its classifier head: the probe's, when it sweeps several."""
    heads = probe_heads(cfg)
    return heads if len(heads) > 1 else []


def best_head(metrics: dict[str, float], heads: list[ProbeHead], prefix: str = "eval") -> int:
    """The index of the head with the best top-1 accuracy, of equals the lowest loss (then the first)."""
    def score(index: int) -> tuple[float, float]:
        name = f"{prefix}/probe/{heads[index].name}"
        return metrics[f"{name}/top1"], -metrics[f"{name}/loss"]

    return max(range(len(heads)), key=score)


def eval_batches(
    num_samples: int, rank: int, world_size: int, batch_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's evaluation batches as (indices, keep mask): each sample is kept on exactly one
    rank, and every rank gets the same number of batches (FSDP gathers weights collectively), so
    a rank with one sample fewer pads with a masked-out sample."""
    sampler = ResumableDistributedSampler(num_samples, rank, world_size, shuffle=False, drop_last=False)
    mine = torch.tensor(list(sampler), dtype=torch.long)
    per_rank = math.ceil(num_samples / world_size)
    indices = torch.zeros(per_rank, dtype=torch.long)
    indices[: len(mine)] = mine
    keep = torch.arange(per_rank) < len(mine)
    return list(zip(indices.split(batch_size), keep.split(batch_size)))


def model_as_trained(cfg: DinoV2FSDPConfig, dist_info: DistInfo, pretrained: bool = True) -> torch.nn.Module:
    """The model as training holds it: on the device, sharded with FSDP2 over the ranks (or on one
    rank with ``fsdp.on_one_rank``), in fp32 with FSDP's bf16 policy or whole under autocast."""
    check_settings(cfg, dist_info)
    model = build_model(cfg.model, pretrained, swept_heads(cfg))
    checkpoint_blocks(model.backbone, cfg.trainer.activation_checkpointing, cfg.model.name)
    model = on_device(model, dist_info.device, cfg.trainer.channels_last)
    if is_sharded(cfg, dist_info):  # bf16 parameters for compute, fp32 gradient reductions
        fully_shard_blocks(model, model.blocks, bf16_parameters=cfg.trainer.precision == "bf16",
                           reshard_after_forward=cfg.fsdp.reshard_after_forward, cpu_offload=cfg.fsdp.cpu_offload)
    return model


def is_sharded(cfg: DinoV2FSDPConfig, dist_info: DistInfo) -> bool:
    return dist_info.distributed or cfg.fsdp.on_one_rank


def compute_precision(cfg: DinoV2FSDPConfig, dist_info: DistInfo) -> str:
    """The autocast precision around the model: none under FSDP, which casts its parameters itself."""
    return "fp32" if is_sharded(cfg, dist_info) else cfg.trainer.precision


def evaluator(cfg: DinoV2FSDPConfig, dist_info: DistInfo, split: str) -> Evaluate:
    """Loss, top-1 and top-5 accuracy over the CIFAR-100 ``split``, from sums over all ranks; the
    whole split on the device, resized to the model's input size batch by batch.

    While the probe sweeps several heads (one backbone forward for all of them) each head's are
    ``eval/probe/<head>/*``, and ``eval/*`` are the best head's."""
    data = cifar100.load_split(cfg.data.root, split)
    images, labels = data.images.to(dist_info.device), data.labels.to(dist_info.device)
    normalize = Normalize(MEAN, STD, dist_info.device, input_max=1)
    batches = eval_batches(len(images), dist_info.rank, dist_info.world_size, cfg.trainer.eval_batch_size)
    precision = compute_precision(cfg, dist_info)
    heads = swept_heads(cfg)

    def evaluate(model: torch.nn.Module, of_ema: bool = False) -> dict[str, float]:
        prefix = metric_prefix(of_ema)
        sums: list[SumMetrics] = []
        inputs = ((to_model_input(images[batch.to(images.device)], cfg.model.image_size, normalize),
                   (labels[batch.to(images.device)], keep.to(images.device))) for batch, keep in batches)
        for logits, (targets, keep) in model_outputs(model, inputs, dist_info.device, precision,
                                                     cfg.trainer.channels_last):
            per_head = logits if logits.ndim == 3 else logits[None]  # [heads, batch, classes] while sweeping
            sums = sums or [SumMetrics(dist_info.device) for _ in per_head]
            for head_sums, head_logits in zip(sums, per_head):
                add_classification(head_sums, head_logits, targets, keep)
        scores = [classification_metrics(head_sums.reduce(), prefix) for head_sums in sums]
        if len(scores) == 1:
            return scores[0]
        metrics = {name.replace(f"{prefix}/", f"{prefix}/probe/{head.name}/"): value
                   for head, score in zip(heads, scores) for name, value in score.items()}
        return scores[best_head(metrics, heads, prefix)] | metrics

    return evaluate


def process_group(cfg: DinoV2FSDPConfig) -> dict[str, bool]:
    """The process group FSDP needs: gloo beside nccl for CPU offload, a group even of one rank."""
    return process_group_options(cfg.fsdp.on_one_rank, cfg.fsdp.cpu_offload)


WHOLE_CLASSIFIER = "Dinov2ForImageClassification"  # its head reads the CLS token and the mean patch token


def export_names(model_cfg: ModelConfig) -> list[tuple[str, str]]:
    if model_cfg.library == "transformers":
        return [("backbone.", "dinov2."), ("head.", "classifier.")]
    return [("backbone.", ""), ("head.", "head.")]


def export_metadata(cfg: DinoV2FSDPConfig) -> dict[str, Any]:
    size = [3, cfg.model.image_size, cfg.model.image_size]
    metadata = {"input": {"size": size, "mean": list(MEAN), "std": list(STD),
                          "pixels": "32x32 images resized to size (bicubic), / 255, then (x - mean) / std"},
                "num_classes": NUM_CLASSES, "classes": cifar100.class_names(cfg.data.root)}
    if cfg.model.library == "transformers":  # transformers' classifier reads one class token and the patch mean
        whole = cfg.model.features == "cls_patch_mean"
        metadata["transformers"] = {"class": WHOLE_CLASSIFIER if whole else "Dinov2Model"}
    elif cfg.model.features == "cls":
        metadata["timm"] = timm_loading(cfg.model.name, NUM_CLASSES, size, MEAN, STD,
                                        {"img_size": cfg.model.image_size})
    return metadata


def write_export_extras(cfg: DinoV2FSDPConfig, folder: Path, metadata: dict[str, Any]) -> None:
    """transformers' ``config.json`` of the backbone, with the classes as its labels."""
    if cfg.model.library != "transformers":
        return
    config = transformers_config(cfg.model)
    config.architectures = [metadata["transformers"]["class"]]
    config.id2label = dict(enumerate(metadata["classes"]))
    config.label2id = {name: index for index, name in enumerate(metadata["classes"])}
    config.save_pretrained(folder)


def predict_input(metadata: dict[str, Any], device: torch.device) -> PredictInput:
    """Image files as CIFAR's 32 px colour images, then upsampled and normalised as the evaluation does."""
    normalize = Normalize(MEAN, STD, device, input_max=1)
    size = metadata["input"]["size"][-1]
    return one_classifier(metadata, FixedSizeImage("RGB", cifar100.IMAGE_SIZE),
                          lambda batch: to_model_input(batch.to(device, non_blocking=True), size, normalize))


def model_from_export(model_cfg: ModelConfig, metadata: dict[str, Any], folder: Path) -> nn.Module:
    if model_cfg.library == "transformers":
        from transformers import Dinov2Config, Dinov2Model

        config = Dinov2Config.from_pretrained(folder)
        config._attn_implementation = "sdpa"
        backbone = Dinov2Model(config)
    else:
        import timm

        backbone = timm.create_model(model_cfg.name, pretrained=False, num_classes=0,
                                     img_size=metadata["input"]["size"][-1])
    return DinoClassifier(backbone, model_cfg.library, model_cfg.features)


SPEC = RecipeSpec(
    schema=DinoV2FSDPConfig,
    model_as_trained=model_as_trained,
    splits=SPLITS,
    evaluator=evaluator,
    export_names=export_names,
    head_names=lambda model_cfg: ["head."],
    training_only=("probe_heads.",),
    export_metadata=export_metadata,
    model_from_export=model_from_export,
    write_export_extras=write_export_extras,
    predict_input=predict_input,
    process_group=process_group,
)
