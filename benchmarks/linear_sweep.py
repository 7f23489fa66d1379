"""dinov2_fsdp's linear-evaluation sweep: a probe step with 8 heads against one head.

The probe step as ``recipes/dinov2_fsdp/train.py`` runs it: the frozen backbone's forward, every
head's cross-entropy summed, the backward (through the heads only) and the recipe's AdamW
(``make_optimizer`` for one head, ``sweep_optimizer`` for several). The backbone runs once per batch
whatever the number of heads, so 8 heads should cost at most 1.1x one. Two pairs: 8 LRs on the
class token (``model.features=cls``) against one head, and 2 LRs x DINOv2's 4 feature variants
(``cls4_patch_mean``) against one head on those features. One and 8 heads alternate, step by step, on
the same batch; the figure is the ratio of their median step times, in CPU time of this process on one
thread (steady on a machine other jobs share). fp32 on a CPU (the recipe's bf16 autocast is a GPU
setting); ViT-S/14 at 224 px (``--quick``: a tiny ViT at 56 px).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.results import Result
from recipes.dinov2_fsdp.model import DINOV2_ARCHITECTURES, DinoClassifier, ProbeHead, narrower_features
from recipes.dinov2_fsdp.train import make_optimizer, sweep_optimizer

BENCHMARK = "dinov2_fsdp linear-evaluation sweep"
LRS = (1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2)  # DINOv2's eval/linear.py grid, the first 8


def build(architecture: dict, image_size: int, features: str, heads: list[ProbeHead]) -> DinoClassifier:
    from transformers import Dinov2Config, Dinov2Model

    config = Dinov2Config(**architecture, image_size=image_size)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = DinoClassifier(Dinov2Model(config), "transformers", features, heads if len(heads) > 1 else ())
    model.set_backbone_trainable(False)
    return model


def probe_step(model: DinoClassifier, optimizer: torch.optim.Optimizer, images: torch.Tensor,
               labels: torch.Tensor) -> None:
    logits = model(images).float()
    if model.probing:
        loss = torch.stack([F.cross_entropy(head, labels, label_smoothing=0.1) for head in logits]).sum()
    else:
        loss = F.cross_entropy(logits, labels, label_smoothing=0.1)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def compare(architecture: dict, image_size: int, batch: int, features: str, heads: list[ProbeHead],
            steps: int) -> list[Result]:
    """Median step time of one head against ``heads``, alternating step by step."""
    one = build(architecture, image_size, features, heads[:1])
    many = build(architecture, image_size, features, heads)
    optimizers = {id(one): make_optimizer(one, heads[0].lr, 0.05),
                  id(many): sweep_optimizer(many.probe_heads.heads, [head.lr for head in heads], 0.05)}
    images, labels = torch.randn(batch, 3, image_size, image_size), torch.randint(0, 100, (batch,))
    times: dict[int, list[float]] = {id(one): [], id(many): []}
    for step in range(steps + 1):
        for model in (one, many) if step % 2 else (many, one):
            start = time.process_time()
            probe_step(model, optimizers[id(model)], images, labels)
            if step:  # the first is a warm-up
                times[id(model)].append(time.process_time() - start)
    one_s, many_s = statistics.median(times[id(one)]), statistics.median(times[id(many)])
    setting = f"{len(heads)} heads ({features}) against 1, batch {batch}, {image_size} px, fp32, {steps} steps each"
    return [Result(BENCHMARK, setting, batch / one_s, "images/s, 1 head", "per second of CPU time, 1 thread"),
            Result(BENCHMARK, setting, batch / many_s, f"images/s, {len(heads)} heads",
                   "per second of CPU time, 1 thread"),
            Result(BENCHMARK, setting, many_s / one_s, "x the time of 1 head", "goal: at most 1.1")]


def run(quick: bool) -> list[Result]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(quick)
    finally:
        torch.set_num_threads(threads)


def _run(quick: bool) -> list[Result]:
    if quick:
        architecture, image_size, batch, steps = {"hidden_size": 64, "num_hidden_layers": 4,
                                                  "num_attention_heads": 2}, 56, 8, 4
    else:
        architecture, image_size, batch, steps = DINOV2_ARCHITECTURES["facebook/dinov2-small"], 224, 8, 8
    lrs_only = [ProbeHead(lr, "cls") for lr in LRS]
    variants = [ProbeHead(lr, part) for part in narrower_features("cls4_patch_mean") for lr in LRS[:2]]
    return [*compare(architecture, image_size, batch, "cls", lrs_only, steps),
            *compare(architecture, image_size, batch, "cls4_patch_mean", variants, steps)]
