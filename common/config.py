"""Config schema pieces every recipe shares (Hydra structured configs).

- ``recipes/<r>/config.py`` subclasses :class:`RunConfig` and holds every default of the recipe:
  its own nodes, and the shared nodes (``trainer``, ``checkpoint``) where its defaults differ.
- Nodes no recipe changes (``profile``, ``logging``) are fields of :class:`RunConfig` itself.
- ``common.entry.recipe_main`` registers the recipe's dataclass with Hydra; ``conf/<r>.yaml``
  composes it with the shared run layout and sets no values.
- Typed: an unknown key or a value of the wrong type fails in one line, before any work.
- One idea, one key in every recipe: ``ema.*``, ``mixup.*``, ``optim.label_smoothing``,
  ``trainer.eval_batch_size``; the metric ``eval/top1`` for top-1 accuracy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class LRScaling(str, Enum):
    none = "none"
    linear = "linear"
    sqrt = "sqrt"


class LogBackend(str, Enum):
    tensorboard = "tensorboard"
    wandb = "wandb"
    none = "none"


class Mode(str, Enum):
    max = "max"
    min = "min"


class Decode(str, Enum):
    """Where training JPEGs become pixels (``common/data/images.py``)."""

    cpu = "cpu"  # DataLoader workers decode, crop and augment; uint8 batches reach the device
    gpu = "gpu"  # workers read the files' bytes; the training device decodes (nvjpeg) and crops each batch
    auto = "auto"  # cpu while the rank's cores keep up with the model on its GPU, else gpu (data/decode_choice.py)


class DataFormat(str, Enum):
    """How a recipe's images are stored (``common/data/file_index.py``, ``common/data/shards.py``)."""

    files = "files"  # one file per image, listed once in a saved file list
    shards = "shards"  # litdata shards, written by `make prep-<recipe> FORMAT=shards`


@dataclass
class ShardsConfig:
    """Where a recipe's shards are (``data.format=shards``) and the node-local cache of a remote's."""

    root: str = "${data.root}/shards"  # a folder, or a remote: s3://..., gs://..., local:/path or file:///path
    cache_dir: str = "${oc.env:TMPDIR,/tmp}/shard-cache"  # node-local: where a remote's chunks are kept
    cache_limit: str = "200GB"  # the cache's bound; the set should fit (ImageNet's is about 150GB)


@dataclass
class ProgressiveConfig:
    """Progressive resizing (FFCV's ResNet-50 recipes): low resolution early, the recipe's training size late.

    The size of each epoch follows from the epoch alone (``common/data/progressive.py``); evaluation keeps its own."""

    start_size: int = 0  # training image size up to start_epoch; 0 = off (every epoch at the recipe's training size)
    start_epoch: int = 0  # epochs count from 0, as FFCV's: the size grows linearly from this epoch ...
    end_epoch: int = 0  # ... to the recipe's training size (timm_imagenet's train_size, fungitastic's image_size) here
    step: int = 32  # every size is a multiple of this


class ActivationCheckpointing(str, Enum):
    """What the backward pass computes again instead of keeping (``common/pytorch/activation_checkpointing.py``)."""

    none = "none"
    blocks = "blocks"  # everything inside each block of the model
    selective = "selective"  # inside transformer blocks, all but their matrix products and attention


class OutOfMemory(str, Enum):
    """What a run does when CUDA runs out of memory in a forward or backward pass (``common/run/out_of_memory.py``)."""

    stop = "stop"  # one line naming the step and a smaller trainer.batch_size to try; exit code 2
    halve = "halve"  # redo the step with half the micro-batch, the global batch kept by accumulation


class Nonfinite(str, Enum):
    """What a run does when its training loss or gradient norm stops being finite (``common/run/divergence.py``)."""

    stop = "stop"  # every rank stops, exit code 3; the last finite checkpoint stays the latest
    rollback = "rollback"  # back to the last finite checkpoint, skipping the batches up to the bad step


COLLECTIVE_TIMEOUT_S = 300.0
"""Default of ``trainer.collective_timeout_s``: seconds a rank waits in a collective before the run is hung.

- Twice the slowest collective we make: one that waits for rank 0's I/O, a synchronous checkpoint
  save or a resume's sha256 checks (their durations: benchmarks/RESULTS.md, "Figures behind
  defaults in common/").
- A hung job wastes 5 minutes of its allocation, not torch's 10 (NCCL) or 30 (gloo).
"""


@dataclass
class TrainerConfig:
    epochs: int = 10
    max_steps: int = 0  # stop after this many optimizer steps; 0 = run all epochs
    batch_size: int = 128  # per rank, per micro-batch
    eval_batch_size: int = 128  # per rank, for evaluation (no gradients: often larger)
    global_batch_size: int = 0  # 0: batch_size x ranks; else kept fixed via gradient accumulation
    lr_scaling: LRScaling = LRScaling.none
    lr_reference_batch_size: int = 256  # the batch size the configured LR was tuned for
    precision: Precision = Precision.fp32
    grad_clip_norm: float = 0.0  # 0 = no clipping
    log_every_steps: int = 50  # train metrics; without a terminal, also a progress line
    eval_every_epochs: int = 1
    # Evaluate (and checkpoint) every N optimizer steps instead of every eval_every_epochs epochs; 0: by epochs.
    eval_every_steps: int = 0
    # Stop after this many evaluations in a row without a better checkpoint.best_metric; 0 = never.
    early_stopping_patience: int = 0
    compile: bool = False
    # Deterministic kernels, no cuDNN autotuning: on a GPU a resumed run then ends bit-identical to an
    # uninterrupted one (same GPU model and software). Off: TF32 matmuls and cuDNN autotuning on CUDA.
    deterministic: bool = False
    channels_last: bool = False
    # Recompute activations in the backward pass to save memory: none | blocks | selective (transformers).
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.none
    num_workers: int = -1  # DataLoader workers per rank; -1: the CPU cores this rank gets (common.data.loaders)
    # stop: one line and exit 2. halve: redo the step with half the micro-batch (the global batch kept), as long
    # as it runs out, down to one sample; the size in use is checkpointed and kept on the same GPU model.
    out_of_memory: OutOfMemory = OutOfMemory.stop
    nonfinite: Nonfinite = Nonfinite.stop
    rollback_lr_factor: float = 1.0  # rollback: the LR (and its schedule) is multiplied by this at each rollback
    max_rollbacks: int = 3  # rollback: after this many, a non-finite step stops the run as with stop
    # Seconds a rank waits in a collective before the run stops as hung (exit 4; common/records/heartbeat.py).
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S


@dataclass
class CheckpointConfig:
    # On the ISC, CHECKPOINT_ARTIFACT_PATH is where checkpoints must go (layout: common/checkpoint/layout.py).
    dir: str = "${oc.env:CHECKPOINT_ARTIFACT_PATH,${run_dir}/checkpoints}"
    every_steps: int = 0  # 0 = not by step count
    every_seconds: float = 30.0  # wall clock; the ISC interrupts every 90 s in rapid cycling
    sync_every_steps: int = 10  # how often ranks agree on time/signal triggers
    keep_last: int = 2  # newest steps kept; ignored in CHECKPOINT_ARTIFACT_PATH, where the ISC does the deleting
    keep_best: bool = True  # the best by best_metric is kept, as a _force directory (the ISC always ships those)
    keep_best_k: int = 0  # the k best by best_metric are kept too, _force (make average BEST=k); 0: the best alone
    best_metric: str = "eval/top1"
    best_mode: Mode = Mode.max
    async_save: bool = False
    resume: bool = True


@dataclass
class LoggingConfig:
    backend: LogBackend = LogBackend.tensorboard
    # On the ISC, LOSSY_ARTIFACT_PATH is where TensorBoard logs must go.
    dir: str = "${oc.env:LOSSY_ARTIFACT_PATH,${run_dir}/tensorboard}"
    progress_bar: bool = True  # a bar on a terminal; otherwise (SLURM, ISC logs) a line every trainer.log_every_steps
    wandb_project: str = "training-recipes"
    wandb_mode: str = "offline"


@dataclass
class EmaConfig:
    """An exponential moving average of the weights (timm's ``ModelEmaV3``).

    - Checkpointed, and evaluated beside the model as ``eval_ema/*``.
    """

    enabled: bool = False
    decay: float = 0.9998  # per optimizer step
    warmup: bool = False  # timm's decay warmup (lower decay early in training)


@dataclass
class MixupConfig:
    """timm's Mixup/CutMix; both alphas 0 = off."""

    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    prob: float = 1.0  # probability of mixing a batch (or element)
    switch_prob: float = 0.5  # probability of CutMix instead of Mixup when both are on
    mode: str = "batch"  # batch | pair | elem


@dataclass
class DistillConfig:
    """Knowledge distillation from a trained model (``common/after_training/distill.py``; docs/after-training.md).

    - The loss is ``(1 - alpha) * <the recipe's loss> + alpha * T^2 * KL(teacher || student)`` of the
      temperature-softened outputs, as DeiT's soft distillation and Hinton et al.
    """

    teacher: str = ""  # a run directory, checkpoint folder or checkpoint, or a `make export` folder; "" = off
    alpha: float = 0.5  # the soft-target term's share of the loss: 0 = the recipe's loss alone, 1 = the teacher's
    temperature: float = 1.0  # softens both distributions; the term is scaled by its square


@dataclass
class FSDPSettings:
    """How FSDP2 shards a model (``common/pytorch/fsdp.py``), in every recipe that can shard it."""

    reshard_after_forward: bool = True  # free the gathered weights after forward (less memory, more traffic)
    # Keep sharded parameters, gradients and optimizer state in host memory (CUDA). The process group
    # then gets gloo beside nccl: gradient clipping reduces the offloaded shards on the CPU.
    cpu_offload: bool = False


@dataclass
class FSDPConfig(FSDPSettings):
    """``fsdp.*`` of a recipe that trains with DDP unless told to shard (timm_imagenet, fungitastic)."""

    enabled: bool = False  # shard with FSDP2 instead of DDP, on one rank too (a process group of one)


@dataclass
class ProfileConfig:
    """``torch.profiler`` traces and CUDA memory snapshots on demand (``common/records/profiling.py``)."""

    enabled: bool = False  # trace optimizer steps start_step .. start_step + active_steps - 1, every rank
    start_step: int = 10  # the first traced optimizer step (steps count from 1)
    active_steps: int = 3
    memory: bool = False  # CUDA: also a memory snapshot (allocation history) of those steps
    # CUDA: record the allocation history from the start; an out-of-memory error then dumps it before the
    # run ends (recording costs some speed and host memory: leave it off unless you are chasing an OOM).
    memory_on_oom: bool = False


@dataclass
class RunConfig:
    """Fields every recipe's top-level config starts with.

    - A recipe's subclass sets ``recipe`` and adds its own nodes (``data``, ``model``, ``optim``, ...).
    - Nodes no recipe changes are here: ``profile``, ``logging``.
    """

    recipe: str = "???"
    name: str = "default"  # the run's name: runs/<recipe>/<name> unless run_dir is set
    run_dir: str = "runs/${recipe}/${name}"  # deterministic, so a restarted job finds its checkpoints
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    # Start from another run's weights (a run directory, a checkpoint folder or directory, or a `make export`
    # folder) with a fresh optimizer, schedule and sampler; a run that resumes its own checkpoint ignores it.
    init_from: str = ""
    init_skip_head: bool = False  # leave the classifier head out of init_from (when the classes differ)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def plain_config(cfg: Any) -> Any:
    """A config (a schema's dataclass, or a node of one) as plain data, enums by name.

    - The same as ``OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)``, without
      validating the schema again (which costs more: benchmarks/RESULTS.md, "Figures behind
      defaults in common/").
    """
    if dataclasses.is_dataclass(cfg):
        return {item.name: plain_config(getattr(cfg, item.name)) for item in dataclasses.fields(cfg)}
    if isinstance(cfg, Enum):
        return cfg.name
    if isinstance(cfg, list | tuple):
        return [plain_config(item) for item in cfg]
    if isinstance(cfg, dict):
        return {key: plain_config(item) for key, item in cfg.items()}
    return cfg


def config_record(cfg: RunConfig) -> dict[str, Any]:
    """``cfg`` as a run records it (``.hydra/config.yaml``, every checkpoint's manifest).

    - Plain data (:func:`plain_config`).
    - Every path inside the run directory is written relative to it (``${run_dir}/checkpoints``):
      a run moved to another folder or machine still finds its own files
      (``common/after_training/trained.py``).
    """
    run_dir = cfg.run_dir.rstrip("/")

    def relocatable(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: relocatable(item) if key != "run_dir" else item for key, item in value.items()}
        if isinstance(value, list):
            return [relocatable(item) for item in value]
        if isinstance(value, str) and value.startswith(run_dir + "/"):
            return "${run_dir}" + value[len(run_dir):]
        return value

    return relocatable(plain_config(cfg))
