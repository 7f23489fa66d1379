"""Every key of every recipe's schema changes what it should.

The keys are read from the schemas themselves (each recipe's ``RunConfig`` dataclass, walked with
``dataclasses.fields``), so a key added later has no check until one is written, and
``test_every_schema_key_has_a_check_or_a_reason`` fails until it has one. A check says what
observable the key must change and to what value (``Check``); the few keys that change nothing a
CPU can see say why, in :data:`NO_EFFECT_ON_A_CPU`. The checks of keys every recipe shares are
here (:data:`CHECKS`); a recipe's own are in its ``recipes/<recipe>/testing.py`` with its tiny
settings (``tests/recipe_tables.py`` reads them), so that a copied recipe brings them along.

Each check runs the recipe's real ``train()`` in this process (``tests/recipe_probe.py``) twice,
with the key as in the tiny test settings and changed, and compares one observable: the model's
weights as built, the LR of every step of the run, the optimizer's groups, the sampler's order,
the first training batch as the model received it, the first step's loss or gradients, an EMA
after two updates, the evaluation's inputs, the metrics a finished run reports, the settings of
the run contract, or the one-line error a bad value gives. Probes are cheap (stopped when the
loop asks for its first step, or after one to three): the base of each recipe and context is made
once, and keys whose observable is a setting of their own (``run.checkpoints.keep_last``) share
one probe with all of them changed.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import sys
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from common.config import plain_config
from common.entry import compose_config, typed_config
from common.pytorch.distributed import DistInfo
from common.recipes import load_recipe
from tests import recipe_tables, trained_runs
from tests.conftest import REPO
from tests.recipe_probe import Configs, Probe, probe, tiny_settings

RECIPES = sorted(path.parent.name for path in (REPO / "recipes").glob("*/spec.py"))


def schema_keys(schema: type) -> list[str]:
    """Every leaf key of a config dataclass, dotted (``optim.lr``), in declaration order."""
    keys = []
    for field in dataclasses.fields(schema):
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        if dataclasses.is_dataclass(default):
            keys += [f"{field.name}.{key}" for key in schema_keys(type(default))]
        else:
            keys.append(field.name)
    return keys


# ---- observables: what a key may change, read from a probe -----------------------------------------

BUILD, STEP, TWO_STEPS, THREE_STEPS, FINISH = "build", "one step", "two steps", "three steps", "finish"
STEPS = {BUILD: 0, STEP: 1, TWO_STEPS: 2, THREE_STEPS: 3, FINISH: None}  # how far a probe runs


def lr_schedule(p: Probe) -> torch.Tensor:
    """The LR of every parameter group at every step of the run, the schedule stepped as the loop
    steps it, then put back."""
    optimizer, scheduler = p.run.optimizer, p.run.scheduler
    groups = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    state = scheduler.state_dict()
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": on purpose here
        try:
            for step in range(1, p.run.plan.total + 1):
                lrs.append([group["lr"] for group in optimizer.param_groups])
                if hasattr(scheduler, "step_update"):  # timm's schedulers, stepped by update count
                    scheduler.step_update(num_updates=step)
                else:
                    scheduler.step()
        finally:
            scheduler.load_state_dict(state)
            for group, saved in zip(optimizer.param_groups, groups):
                group.update(saved)
    return torch.tensor(lrs, dtype=torch.float64)


def optimizer_groups(p: Probe) -> list[Any]:
    """The optimizer's class and each group's settings and size."""
    optimizer = p.run.optimizer
    return [type(optimizer).__name__, *({key: len(value) if key == "params" else value for key, value in group.items()}
                                        for group in optimizer.param_groups)]


def sampler_order(p: Probe) -> list[Any]:
    sampler = p.run.sampler
    return [type(sampler).__name__, sampler.num_samples, sampler.global_order(0)]


def train_source(p: Probe) -> Any:
    """The source of the training loader's images (a file list, shards), under its wrappers."""
    dataset = p.micro_batches.dataset
    if hasattr(dataset, "by_size"):  # ProgressiveImages: one PerSampleSeeded per size, each over the same source
        dataset = next(iter(dataset.by_size.values()))
    return dataset.dataset.images  # PerSampleSeeded, TrainImages


def train_files(p: Probe) -> list[str]:
    """The image files the training loader reads (or the shards it reads them from)."""
    dataset = train_source(p)
    while not hasattr(dataset, "paths"):
        if hasattr(dataset, "location"):  # ShardImages
            return [dataset.location, dataset.cache_dir, dataset.cache_limit]
        dataset = dataset.dataset
    return sorted(map(str, dataset.paths))


def train_list(p: Probe) -> str | None:
    """Which making of the saved file list the training loader reads (each making has a token of its own)."""
    return train_source(p).index.info.get("token")  # none when `make prep-<recipe>` made it


def epoch_sizes(p: Probe) -> list[int]:
    """The training image size of every epoch of the run (``data.progressive``), as the loader makes them."""
    return [p.micro_batches.dataset.sizes.of_epoch(epoch) for epoch in range(p.run.plan.epochs)]


def profiled_steps(p: Probe) -> list[str]:
    """The optimizer steps the traces under ``<run_dir>/profile/`` hold, by file."""
    import gzip
    import json

    traces = sorted((Path(p.run.run_dir) / "profile").glob("*.pt.trace.json.gz"))
    return [(trace.name, sorted({event["name"] for event in json.loads(gzip.decompress(trace.read_bytes()))
                                 ["traceEvents"] if event.get("name", "").startswith("ProfilerStep#")}))
            for trace in traces]


def checkpointed_blocks(p: Probe) -> list[tuple[str, str]]:
    """The modules whose activations the backward pass recomputes, and how."""
    return [(name, module._activation_checkpointing.value) for name, module in p.run.model.named_modules()
            if hasattr(module, "_activation_checkpointing")]


def wandb_init(name: str) -> Callable[[Probe], Any]:
    return lambda p: p.wandb_init[name]


OBSERVABLES: dict[str, tuple[str, Callable[[Probe], Any]]] = {
    "error": (BUILD, lambda p: p.error),
    "run directory": (BUILD, lambda p: p.run.run_dir),
    "planned steps": (BUILD, lambda p: p.run.plan.total),
    "weights": (BUILD, lambda p: p.run.model.state_dict()),
    "lr schedule": (BUILD, lr_schedule),
    "optimizer": (BUILD, optimizer_groups),
    "sampler": (BUILD, sampler_order),
    "compiled": (BUILD, lambda p: len(p.compiled)),
    "train files": (BUILD, train_files),
    "checkpointed blocks": (BUILD, checkpointed_blocks),
    "train list": (BUILD, train_list),
    "epoch sizes": (BUILD, epoch_sizes),
    "wandb project": (BUILD, wandb_init("project")),
    "wandb mode": (BUILD, wandb_init("mode")),
    "first batch": (STEP, lambda p: p.inputs[0]),
    "first loss": (STEP, lambda p: p.losses[0]),
    "first gradients": (STEP, lambda p: p.gradients[0]),
    "logged at": (TWO_STEPS, lambda p: p.logged_at),
    "profiled steps": (THREE_STEPS, profiled_steps),
    # timm's EMA copies the weights at its first update and averages from the second on
    "ema after two updates": (THREE_STEPS, lambda p: p.run.extra_state["ema"].state_dict()),
    "eval batches": (FINISH, lambda p: p.eval_inputs),
    "final metrics": (FINISH, lambda p: sorted(p.summary["metrics"])),
}


def observable(name: str) -> tuple[str, Callable[[Probe], Any]]:
    """An observable by name; ``run.<attribute path>`` or ``micro_batches.<path>`` read one setting
    of what the recipe built (the run contract, its training loader)."""
    if name in OBSERVABLES:
        return OBSERVABLES[name]
    root, _, path = name.partition(".")
    if root not in ("run", "micro_batches"):
        raise KeyError(f"no observable {name!r}")

    def read(p: Probe) -> Any:
        value = getattr(p, root)
        for part in path.split("."):
            value = getattr(value, part)
        return sorted(value) if isinstance(value, dict) else value

    return BUILD, read


def is_own_setting(name: str) -> bool:
    """Whether the observable reads only the key's own setting, so that one probe may change
    several such keys at once and each check still sees only its own key. (The keys so grouped
    must not change each other's settings: ``trainer.max_steps``, whose plan total the epochs and
    the global batch change too, has an observable of its own.)"""
    return name.startswith(("run.", "micro_batches.", "wandb "))


def same(a: Any, b: Any) -> bool:
    """Equal values, and for tensors also equal shape, dtype and memory layout."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


class FakeWandb(types.ModuleType):
    """``wandb`` for the logging keys: records how each run was started, sends nothing."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict[str, Any]] = []

    def init(self, **kwargs: Any) -> Any:
        self.inits.append(kwargs)
        return types.SimpleNamespace(log=lambda *args, **kw: None, finish=lambda: None)


FAKE_WANDB = FakeWandb()


# ---- the registry: each key, what it must change, or why it changes nothing here ------------------


@dataclass(frozen=True)
class Check:
    """Changing the key by ``change`` (overrides) must change ``observable``; both runs have
    ``context`` (where the key matters only with another setting). ``{name}`` in an override is a
    file or folder the test makes (see :class:`Resources`). ``default_run_dir``: both runs keep the
    schema's run directory (``runs/<recipe>/<name>``, in a scratch working directory)."""

    observable: str
    change: tuple[str, ...]
    context: tuple[str, ...] = ()
    default_run_dir: bool = False


def check(observable: str, *change: str, context: tuple[str, ...] = (), default_run_dir: bool = False) -> Check:
    return Check(observable, change, context, default_run_dir)


MIXUP_ON = ("mixup.mixup_alpha=0.8",)
EMA_ON = ("ema.enabled=true",)
TEACHER = ("distill.teacher={init_source}",)
CHANNELS_FIRST = ("trainer.channels_last=false",)
PROFILED = ("profile.enabled=true", "profile.start_step=1", "profile.active_steps=1")
SAME_RUN_DIR = ("run_dir={tmp}/same",)  # the folders that default to ${run_dir}/... then differ by their key alone
SHARDS = ("data.format=shards", "data.shards.root={shards}")
REMOTE_SHARDS = ("data.format=shards", "data.shards.root=file://{shards}")
# data.progressive: epochs 0-4 at 16, 16, 24, 32, 32 px, on a convolutional network (fungitastic's test_vit has
# 16 px patches, which do not tile 24 px)
GROWING = ("model.name=test_resnet", "data.progressive.start_size=16", "data.progressive.step=8",
           "data.progressive.end_epoch=4")
# The keys of the JPEG recipes' data sources (issue 37): what they read their images from (in CHECKS).
DATA_SOURCE_CHECKS = {
    "data.format": check("train files", "data.format=shards", context=SHARDS[1:]),
    "data.shards.root": check("train files", "data.shards.root={shards_copy}", context=SHARDS),
    "data.shards.cache_dir": check("train files", "data.shards.cache_dir={tmp}/other_cache", context=REMOTE_SHARDS),
    "data.shards.cache_limit": check("train files", "data.shards.cache_limit=1GB", context=REMOTE_SHARDS),
    "data.rebuild_index": check("train list", "data.rebuild_index=true"),
}

# Keys every recipe has (common/config.py), and the same idea under the same name where recipes share it.
CHECKS: dict[str, Check] = {
    # the run: its recipe, name and directory, its seed, its starting weights
    "recipe": check("run.recipe", "recipe=renamed"),
    "name": check("run.run_dir", "name=renamed", default_run_dir=True),
    "run_dir": check("run directory", "run_dir={tmp}/elsewhere"),
    "seed": check("weights", "seed=1"),
    "init_from": check("weights", "init_from={init_source}"),
    "init_skip_head": check("weights", "init_skip_head=true", context=("init_from={init_source}",)),
    "data.root": check("error", "data.root={missing}"),
    # trainer: the plan of steps, the loop, the run contract
    "trainer.epochs": check("run.plan.epochs", "trainer.epochs=3"),
    "trainer.max_steps": check("planned steps", "trainer.max_steps=1"),
    "trainer.batch_size": check("first batch", "trainer.batch_size=2"),
    "trainer.eval_batch_size": check("eval batches", "trainer.eval_batch_size=3"),
    "trainer.global_batch_size": check("run.plan.accumulate", "trainer.global_batch_size=16"),
    "trainer.lr_scaling": check("lr schedule", "trainer.lr_scaling=sqrt"),
    "trainer.lr_reference_batch_size": check("lr schedule", "trainer.lr_reference_batch_size=64",
                                             context=("trainer.lr_scaling=linear",)),
    "trainer.precision": check("first loss", "trainer.precision=bf16", context=("trainer.precision=fp32",)),
    "trainer.grad_clip_norm": check("first gradients", "trainer.grad_clip_norm=0.001"),
    "trainer.log_every_steps": check("logged at", "trainer.log_every_steps=1"),
    "trainer.eval_every_epochs": check("run.trainer.eval_every_epochs", "trainer.eval_every_epochs=2"),
    # a probe of its own: changed with the other keys, eval_every_epochs too, the run would refuse both cadences
    "trainer.eval_every_steps": check("run.evaluations.every_steps", "trainer.eval_every_steps=2",
                                      context=("trainer.eval_every_epochs=1",)),
    "trainer.early_stopping_patience": check("run.early_stopping.patience", "trainer.early_stopping_patience=2"),
    "trainer.compile": check("compiled", "trainer.compile=true"),
    "trainer.channels_last": check("first batch", "trainer.channels_last=true", context=CHANNELS_FIRST),
    "trainer.activation_checkpointing": check("checkpointed blocks", "trainer.activation_checkpointing=blocks"),
    "trainer.num_workers": check("micro_batches.num_workers", "trainer.num_workers=1"),
    "trainer.nonfinite": check("run.divergence.nonfinite", "trainer.nonfinite=rollback"),
    # what a step that runs out of memory does: tests/test_out_of_memory.py
    "trainer.out_of_memory": check("run.out_of_memory.mode", "trainer.out_of_memory=halve"),
    "trainer.rollback_lr_factor": check("run.divergence.rollback_lr_factor", "trainer.rollback_lr_factor=0.5"),
    "trainer.max_rollbacks": check("run.divergence.max_rollbacks", "trainer.max_rollbacks=7"),
    # profile: traces of chosen steps
    "profile.enabled": check("profiled steps", "profile.enabled=true", context=PROFILED[1:]),
    "profile.start_step": check("profiled steps", "profile.start_step=2", context=PROFILED),
    "profile.active_steps": check("profiled steps", "profile.active_steps=2", context=PROFILED),
    # checkpoint: where, how often, what is kept
    "checkpoint.dir": check("run.checkpoints.directory", "checkpoint.dir={tmp}/checkpoints", context=SAME_RUN_DIR),
    "checkpoint.every_steps": check("run.cadence.every_steps", "checkpoint.every_steps=5"),
    "checkpoint.every_seconds": check("run.cadence.every_seconds", "checkpoint.every_seconds=11"),
    "checkpoint.keep_last": check("run.checkpoints.keep_last", "checkpoint.keep_last=4"),
    "checkpoint.keep_best": check("run.checkpoints.keep_best", "checkpoint.keep_best=false"),
    "checkpoint.keep_best_k": check("run.checkpoints.keep_best_k", "checkpoint.keep_best_k=3"),
    "checkpoint.best_metric": check("run.checkpoints.best_metric", "checkpoint.best_metric=eval/other"),
    "checkpoint.best_mode": check("run.checkpoints.best_mode", "checkpoint.best_mode=min"),
    "checkpoint.async_save": check("run.checkpoints.async_save", "checkpoint.async_save=true",
                                   context=("checkpoint.async_save=false",)),
    "checkpoint.resume": check("run.cfg.checkpoint.resume", "checkpoint.resume=false"),
    # logging
    "logging.backend": check("run.logger.backend", "logging.backend=tensorboard"),
    "logging.dir": check("run.logger.log_dir", "logging.dir={tmp}/logs", context=SAME_RUN_DIR),
    "logging.progress_bar": check("run.logger.progress_bar", "logging.progress_bar=true"),
    "logging.wandb_project": check("wandb project", "logging.wandb_project=renamed",
                                   context=("logging.backend=wandb",)),
    "logging.wandb_mode": check("wandb mode", "logging.wandb_mode=disabled", context=("logging.backend=wandb",)),
    # ema.* and mixup.*, where a recipe has them
    "ema.enabled": check("run.extra_state", "ema.enabled=true"),
    "ema.decay": check("ema after two updates", "ema.decay=0.5", context=EMA_ON),
    "ema.warmup": check("ema after two updates", "ema.warmup=true", context=EMA_ON),
    "mixup.mixup_alpha": check("first batch", "mixup.mixup_alpha=0.8"),
    "mixup.cutmix_alpha": check("first batch", "mixup.cutmix_alpha=1.0"),
    "mixup.prob": check("first batch", "mixup.prob=0.0", context=MIXUP_ON),
    "mixup.switch_prob": check("first batch", "mixup.switch_prob=1.0",
                               context=(*MIXUP_ON, "mixup.cutmix_alpha=1.0", "mixup.switch_prob=0.0")),
    "mixup.mode": check("first batch", "mixup.mode=elem", context=MIXUP_ON),
    # distill.*, where a recipe has them: the teacher is a checkpoint of the recipe's model from another seed
    "distill.teacher": check("first loss", "distill.teacher={init_source}"),
    "distill.alpha": check("first loss", "distill.alpha=1.0", context=TEACHER),
    "distill.temperature": check("first loss", "distill.temperature=4.0", context=TEACHER),
    # optim.* keys most recipes share
    "optim.lr": check("lr schedule", "optim.lr=0.5"),
    "optim.weight_decay": check("optimizer", "optim.weight_decay=0.3"),
    "optim.momentum": check("optimizer", "optim.momentum=0.5"),
    "optim.warmup_epochs": check("lr schedule", "optim.warmup_epochs=2"),
    "optim.min_lr_ratio": check("lr schedule", "optim.min_lr_ratio=0.5"),
    "optim.label_smoothing": check("first loss", "optim.label_smoothing=0.3"),
    # the data sources of the recipes that read JPEGs
    **DATA_SOURCE_CHECKS,
    # data.progressive (timm_imagenet, fungitastic): the first epochs at 16 px, the last at the tiny settings' 32 px
    "data.progressive.start_size": check("first batch", "data.progressive.start_size=32", context=GROWING),
    "data.progressive.start_epoch": check("epoch sizes", "data.progressive.start_epoch=2", context=GROWING),
    "data.progressive.end_epoch": check("epoch sizes", "data.progressive.end_epoch=8", context=GROWING),
    "data.progressive.step": check("epoch sizes", "data.progressive.step=16", context=GROWING),
}

# Each recipe's own keys: KEY_CHECKS in recipes/<recipe>/testing.py (tests/recipe_tables.py), so that a
# copied recipe brings its checks along.
RECIPE_CHECKS: dict[str, dict[str, Check]] = {
    recipe: {key: check(observable, *change, context=context)
             for key, (observable, change, context) in recipe_tables.key_checks(recipe).items()}
    for recipe in recipe_tables.DECLARED
}

# Keys whose effect no CPU run can show, and why ("key" for every recipe, "recipe:key" for one).
NO_EFFECT_ON_A_CPU: dict[str, str] = {
    "device": "one device here: auto is the CPU on a machine without CUDA, and device=cuda stops in one line "
              "before any work (tests/test_distributed.py::test_asking_for_cuda_without_a_gpu_is_a_user_error)",
    "trainer.deterministic": "switches CUDA's deterministic kernels, cuDNN autotuning and TF32; every CPU run is "
                             "deterministic already (the switches: tests/test_determinism.py)",
    "trainer.collective_timeout_s": "how long a rank waits in a collective before the run is declared hung; one "
                                    "process waits for no other (2 ranks: tests/test_hangs.py)",
    "profile.memory": "records CUDA allocations; a run on a CPU says in one line that it has none to record "
                      "(tests/test_profiling.py)",
    "profile.memory_on_oom": "records CUDA allocations for CUDA's out-of-memory error; the error's line is "
                             "tests/test_records.py's",
    "checkpoint.sync_every_steps": "how often several ranks agree on saving and stopping; one process agrees with "
                                   "itself every step whatever it says (2 ranks: tests/test_distributed.py::"
                                   "test_two_gloo_ranks_reduce_exactly_and_agree_when_to_stop)",
    # each recipe's own: NO_EFFECT_ON_A_CPU in recipes/<recipe>/testing.py
    **{f"{recipe}:{key}": why for recipe in recipe_tables.DECLARED
       for key, why in recipe_tables.no_effect_on_a_cpu(recipe).items()},
}


def check_of(recipe: str, key: str) -> Check | str | None:
    """The key's check in ``recipe``, or the reason it has none, or None."""
    return (RECIPE_CHECKS.get(recipe, {}).get(key) or NO_EFFECT_ON_A_CPU.get(f"{recipe}:{key}")
            or NO_EFFECT_ON_A_CPU.get(key) or CHECKS.get(key))


def keys_of(recipe: str) -> list[str]:
    return schema_keys(load_recipe(recipe).schema)


def test_every_schema_key_has_a_check_or_a_reason_it_has_no_effect_on_a_cpu() -> None:
    uncovered = [f"{recipe}:{key}" for recipe in RECIPES for key in keys_of(recipe) if check_of(recipe, key) is None]
    assert not uncovered, (f"{len(uncovered)} config key(s) without a check that changing them changes the run: "
                           f"{', '.join(uncovered)}; add one to KEY_CHECKS in recipes/<recipe>/testing.py (or the "
                           f"reason there is none to its NO_EFFECT_ON_A_CPU; tests/recipe_tables.py says how)")
    untried = [recipe for recipe in RECIPES if recipe not in trained_runs.TINY]
    assert not untried, (f"no tiny settings to check {untried} with: declare them in recipes/<recipe>/testing.py "
                         f"(TINY, TINY_DATA; tests/recipe_tables.py says how)")


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_config_as_plain_data_is_what_omegaconf_makes_of_it(recipe: str) -> None:
    """``plain_config`` (what ``.hydra/config.yaml``, the manifests and the loggers record) walks the
    dataclasses itself; OmegaConf's conversion is the reference, key order and enum names included."""
    cfg = typed_config(compose_config(recipe, ["trainer.precision=bf16", "trainer.lr_scaling=sqrt"]))
    expected = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    assert plain_config(cfg) == expected
    assert json.dumps(plain_config(cfg)) == json.dumps(expected)  # the same order at every level


def test_the_registry_names_only_keys_that_exist_and_observables_it_knows() -> None:
    everywhere = {key for recipe in RECIPES for key in keys_of(recipe)}
    named = [*CHECKS, *(f"{recipe}:{key}" for recipe, checks in RECIPE_CHECKS.items() for key in checks),
             *NO_EFFECT_ON_A_CPU]
    stale = []
    for name in named:
        recipe, _, key = name.rpartition(":")
        if key not in (keys_of(recipe) if recipe in RECIPES else set() if recipe else everywhere):
            stale.append(name)
    assert not stale, f"the registry names keys no schema has: {stale}"
    for recipe in RECIPES:
        for key in keys_of(recipe):
            found = check_of(recipe, key)
            if isinstance(found, Check) and found.observable not in SPECIAL:
                observable(found.observable)  # raises for a name it does not know


# ---- the probes -------------------------------------------------------------------------------------


class Resources:
    """Files and folders a check names as ``{name}``, made the first time one is asked for."""

    def __init__(self, recipe: str, factory: pytest.TempPathFactory, configs: Configs) -> None:
        self.recipe, self.factory, self.configs = recipe, factory, configs
        self.tmp = factory.mktemp(f"{recipe}-keys")
        self.made: dict[str, str] = {"tmp": str(self.tmp), "missing": str(self.tmp / "missing")}

    def __getitem__(self, name: str) -> str:
        if name not in self.made:
            with torch.random.fork_rng(devices=[]):  # the makers seed torch: leave the process's generator alone
                self.made[name] = str(getattr(self, name)())
        return self.made[name]

    def init_source(self) -> Path:
        """A checkpoint of this recipe's model initialised from another seed."""
        source = probe(self.recipe, self.configs("seed=1"))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # dinov2's shards, one process
            source.run.save()
        return Path(source.cfg.checkpoint.dir)

    def timm_weights(self) -> Path:
        import timm

        torch.manual_seed(1)
        path = self.tmp / "test_resnet.pth"
        torch.save(timm.create_model("test_resnet", num_classes=3).state_dict(), path)
        return path

    def _segmentation_model(self) -> torch.nn.Module:
        import torchvision

        torch.manual_seed(1)
        return torchvision.models.get_model("deeplabv3_mobilenet_v3_large", num_classes=21, aux_loss=True,
                                            weights_backbone=None)

    def seg_weights(self) -> Path:
        torch.save(self._segmentation_model().state_dict(), self.tmp / "deeplabv3.pth")
        return self.tmp / "deeplabv3.pth"

    def seg_backbone(self) -> Path:
        torch.save(self._segmentation_model().backbone.state_dict(), self.tmp / "backbone.pth")
        return self.tmp / "backbone.pth"

    def fungi_weights(self) -> Path:
        import timm

        torch.manual_seed(1)
        path = self.tmp / "test_vit.pth"
        torch.save(timm.create_model("test_vit", num_classes=0, img_size=32).state_dict(), path)
        return path

    def fungi_missing(self) -> Path:
        """The tiny FungiTastic with one training image gone."""
        import shutil

        copy = self.tmp / "fungi_missing"
        shutil.copytree(trained_runs.tiny_files(self.recipe, self.factory)["data.root"], copy)
        next(iter(sorted((copy / "FungiTastic-Mini" / "train").rglob("*.JPG")))).unlink()
        for saved in (copy / "prepared").rglob("*.index.npz"):  # listed before the image went: listed again
            saved.unlink()
        return copy

    def fungi_class_weights(self) -> Path:
        """The tiny FungiTastic's prepared folder with species weights 1, 2, 3, 4."""
        import shutil

        metadata = importlib.import_module(f"recipes.{self.recipe}.metadata")
        prepared = self.tmp / "prepared"
        shutil.copytree(Path(trained_runs.tiny_files(self.recipe, self.factory)["data.root"]) / "prepared", prepared)
        weights_file = prepared / metadata.subset_dir("mini") / metadata.CLASS_WEIGHTS_FILE
        weights = torch.load(weights_file, weights_only=True)
        weights["species"] = torch.arange(1.0, len(weights["species"]) + 1)
        torch.save(weights, weights_file)
        return prepared

    def shards(self) -> Path:
        """The tiny data's shards (written once per session)."""
        return trained_runs.tiny_shards(self.recipe, self.factory)

    def shards_copy(self) -> Path:
        import shutil

        shutil.copytree(self["shards"], self.tmp / "shards_copy")
        return self.tmp / "shards_copy"

    def _dinov2(self, name: str, seed: int, layers: int) -> Path:
        from transformers import Dinov2Config, Dinov2Model

        torch.manual_seed(seed)
        Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, mlp_ratio=2,
                                 image_size=42, patch_size=14)).save_pretrained(self.tmp / name)
        return self.tmp / name

    def dinov2_backbone(self) -> Path:
        return trained_runs.dinov2_backbone(self.factory)

    def dinov2_weights(self) -> Path:
        return self._dinov2("dinov2_other_weights", seed=7, layers=2)

    def dinov2_architecture(self) -> Path:
        return self._dinov2("dinov2_one_layer", seed=123, layers=1)

    def substitute(self, overrides: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(re.sub(r"\{(\w+)\}", lambda match: self[match.group(1)], override) for override in overrides)


def batchnorm_on_two_ranks(recipe: str, cfg: Any) -> int:
    """How many BatchNorm layers of the model training holds on 2 ranks synchronise across them."""
    synchronised = importlib.import_module(f"recipes.{recipe}.sync_batchnorm").AllReduceBatchNorm
    two_ranks = DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), launcher="torchrun")
    model = load_recipe(recipe).model_as_trained(cfg, two_ranks, False)
    return sum(isinstance(module, synchronised) for module in model.modules())


def process_group(recipe: str, cfg: Any) -> dict[str, Any]:
    """What the recipe asks ``init_distributed`` to make (FSDP2 on one rank: a group of one)."""
    return load_recipe(recipe).process_group(cfg)


# observables read from the config alone, without a probe
SPECIAL: dict[str, Callable[[str, Any], Any]] = {"batchnorm on two ranks": batchnorm_on_two_ranks,
                                                  "process group": process_group}


class KeyProbes:
    """The probes of one recipe's checks, each base probe made once (a few kept at a time)."""

    def __init__(self, recipe: str, factory: pytest.TempPathFactory) -> None:
        self.recipe = recipe
        self.configs = Configs(recipe, factory.mktemp(f"{recipe}-runs"), tiny_settings(recipe, factory))
        self.resources = Resources(recipe, factory, self.configs)
        self.workdir = factory.mktemp(f"{recipe}-workdir")
        self.bases: OrderedDict[tuple, Probe] = OrderedDict()
        self.joint: dict[tuple, Probe] = {}

    def run(self, kind: str, overrides: tuple[str, ...], default_run_dir: bool) -> Probe:
        overrides = self.resources.substitute(overrides)
        if kind == FINISH:
            overrides = ("trainer.max_steps=1", *overrides)
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(sys.modules, "wandb", FAKE_WANDB)
            if default_run_dir:
                patch.chdir(self.workdir)
            started = len(FAKE_WANDB.inits)
            seen = probe(self.recipe, self.configs(*overrides, default_run_dir=default_run_dir), STEPS[kind])
        seen.wandb_init = FAKE_WANDB.inits[-1] if len(FAKE_WANDB.inits) > started else None
        return seen

    def base(self, kind: str, found: Check) -> Probe:
        key = (kind, found.context, found.default_run_dir)
        if key not in self.bases:
            self.bases[key] = self.run(kind, found.context, found.default_run_dir)
            while len(self.bases) > 3:
                self.bases.popitem(last=False)
        return self.bases[key]

    def changed(self, kind: str, found: Check) -> Probe:
        if not is_own_setting(found.observable):
            return self.run(kind, (*found.context, *found.change), found.default_run_dir)
        # every own-setting check of this recipe with the same context, changed together
        key = (kind, found.context, found.default_run_dir)
        if key not in self.joint:
            together = [other.change for other in checks_of(self.recipe).values()
                        if isinstance(other, Check) and is_own_setting(other.observable)
                        and (other.context, other.default_run_dir) == key[1:]]
            self.joint[key] = self.run(kind, (*found.context, *(o for change in together for o in change)),
                                       found.default_run_dir)
        return self.joint[key]


def checks_of(recipe: str) -> dict[str, Check | str]:
    return {key: check_of(recipe, key) for key in keys_of(recipe)}


_probes: dict[str, KeyProbes] = {}


@pytest.fixture(scope="module", autouse=True)
def _free_the_probes() -> Iterator[None]:
    """Probes hold models, inputs and gradients: let them go when this module's tests are done."""
    yield
    _probes.clear()


def probes_of(recipe: str, factory: pytest.TempPathFactory) -> KeyProbes:
    if recipe not in _probes:
        _probes.clear()  # the cases of one recipe run together: the previous recipe's probes are done
        _probes[recipe] = KeyProbes(recipe, factory)
    return _probes[recipe]


def _cases() -> list[Any]:
    """Every (recipe, key) with a check, those sharing a probe next to each other."""
    cases = []
    for recipe in RECIPES:
        checks = [(key, found) for key, found in checks_of(recipe).items() if isinstance(found, Check)]
        order = {kind: i for i, kind in enumerate(STEPS)}
        checks.sort(key=lambda item: (order[observable_kind(item[1].observable)], item[1].context))
        cases += [pytest.param(recipe, key, id=f"{recipe}-{key}") for key, _ in checks]
    return cases


def observable_kind(name: str) -> str:
    return BUILD if name in SPECIAL else observable(name)[0]


@pytest.mark.parametrize(("recipe", "key"), _cases())
def test_changing_a_key_changes_what_it_should(recipe: str, key: str,
                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    found = check_of(recipe, key)
    probes = probes_of(recipe, tmp_path_factory)
    if found.observable in SPECIAL:
        configs, resources = probes.configs, probes.resources
        read = SPECIAL[found.observable]
        before = read(recipe, configs(*resources.substitute(found.context)))
        after = read(recipe, configs(*resources.substitute((*found.context, *found.change))))
        assert before != after, f"{recipe}: {' '.join(found.change)} left {found.observable} at {before}"
        return
    kind, read = observable(found.observable)
    base, changed = probes.base(kind, found), probes.changed(kind, found)
    if found.observable != "error":
        for which, seen in (("as set", base), ("changed", changed)):
            assert seen.error is None, f"{recipe} with {key} {which} stopped: {seen.error}"
    assert not same(read(base), read(changed)), \
        f"{recipe}: changing {key} ({' '.join(found.change)}) left the {found.observable} as it was"
