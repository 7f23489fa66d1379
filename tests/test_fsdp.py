"""``fsdp.enabled`` in timm_imagenet and fungitastic: FSDP2 (each block a unit) in place of DDP, on 2
gloo ranks launched by torchrun.

FSDP2 keeps fp32 parameters and the recipes' autocast computes as under DDP, so a sharded run is the
DDP run, bit for bit (fp32 on the CPU; the weights in PyTorch's layout, since FSDP2 shards no
channels-last tensor). Its checkpoints hold each rank's shards: a run of 2 ranks resumes on 1 and a
run of 1 on 2 (``trainer.global_batch_size`` kept, so the plan is the same), the shards loaded on the
other number of ranks and saved again unchanged; and ``make eval`` reads them on either number, its
metrics those the run reported (the 9 images of the tiny splits give the 2 ranks 5 and 4 images, and
FSDP2's forwards gather weights collectively, so the rank with fewer batches runs one more forward).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.after_training.trained import read_state
from common.checkpoint.layout import committed_checkpoints
from tests.conftest import REPO, assert_ok, read_summary, recipe_env, run_recipe
from tests.test_dinov2_fsdp import copy_checkpoints_up_to, sharded_tensors
from tests.trained_runs import TINY, fungi_data, imagenet_data

RECIPES = ("timm_imagenet", "fungitastic")
EXACT = ["trainer.precision=fp32", "trainer.channels_last=false", "checkpoint.every_steps=1",
         "checkpoint.keep_last=100", "trainer.epochs=2", "trainer.eval_batch_size=2", "seed=5"]
SETTINGS = {  # 24 training images in 3 steps of 8 per epoch; fungitastic's minimal split: 8 in 2 of 4
    "timm_imagenet": ["trainer.batch_size=4", "trainer.global_batch_size=8"],
    "fungitastic": ["trainer.batch_size=2", "trainer.global_batch_size=4", "data.minimal=true"],
}
STEPS = {"timm_imagenet": 6, "fungitastic": 4}


def overrides(recipe: str, factory: pytest.TempPathFactory, run_dir: Path, *extra: str) -> list[str]:
    data = {"timm_imagenet": imagenet_data, "fungitastic": fungi_data}[recipe](factory)
    return [*TINY[recipe], f"data.root={data}", f"run_dir={run_dir}", *EXACT, *SETTINGS[recipe], *extra]


_runs: dict[tuple[str, bool, int], Path] = {}


def trained(recipe: str, sharded: bool, nproc: int, factory: pytest.TempPathFactory) -> Path:
    """A whole run of ``recipe`` with FSDP2 or DDP on ``nproc`` ranks, made once."""
    key = (recipe, sharded, nproc)
    if key not in _runs:
        run_dir = factory.mktemp(f"{recipe}-{'fsdp' if sharded else 'ddp'}-{nproc}") / "run"
        result = run_recipe(recipe, overrides(recipe, factory, run_dir, f"fsdp.enabled={sharded}"), nproc=nproc)
        assert_ok(result)
        assert f"{nproc} rank(s) on cpu{' with FSDP2' if sharded else ','}" in result.stdout
        _runs[key] = run_dir
    return _runs[key]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_fsdp2_on_two_ranks_trains_exactly_as_ddp_does(recipe: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    sharded, ddp = read_summary(trained(recipe, True, 2, tmp_path_factory)), \
        read_summary(trained(recipe, False, 2, tmp_path_factory))
    assert sharded["steps"] == ddp["steps"] == STEPS[recipe] and sharded["world_size"] == 2
    assert sharded["model_digest"] == ddp["model_digest"]
    assert sharded["metrics"] == ddp["metrics"]
    for checkpoint in committed_checkpoints(trained(recipe, True, 2, tmp_path_factory) / "checkpoints"):
        assert (checkpoint.path / "sharded").is_dir() and "model" not in read_state(checkpoint.path)


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "saved_on", "resumed_on"), [("timm_imagenet", 2, 1), ("fungitastic", 1, 2)])
def test_a_sharded_checkpoint_resumes_on_another_number_of_ranks(
        recipe: str, saved_on: int, resumed_on: int, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    source = trained(recipe, True, saved_on, tmp_path_factory)
    at = STEPS[recipe] // 2 + 1  # inside the second epoch

    # Loaded on the other number of ranks and saved again (max_steps stops before any new step): the same shards.
    exact = tmp_path / "exact"
    copy_checkpoints_up_to(source, exact, at)
    assert_ok(run_recipe(recipe, overrides(recipe, tmp_path_factory, exact, "fsdp.enabled=true",
                                           f"trainer.max_steps={at}"), nproc=resumed_on))
    original, resaved = sharded_tensors(source, at, tmp_path), sharded_tensors(exact, at, tmp_path)
    for part in ("model", "optimizer"):
        flat_original, flat_resaved = _flat(original[part]), _flat(resaved[part])
        assert flat_original.keys() == flat_resaved.keys()
        for name, value in flat_original.items():
            assert torch.equal(flat_resaved[name], value), f"{part} {name} changed in the resharding"

    # Continued there, it finishes the run.
    continued = tmp_path / "continued"
    copy_checkpoints_up_to(source, continued, at)
    result = run_recipe(recipe, overrides(recipe, tmp_path_factory, continued, "fsdp.enabled=true"), nproc=resumed_on)
    assert_ok(result)
    assert f"(step {at}, epoch 1)" in result.stdout
    summary = read_summary(continued)
    assert summary["world_size"] == resumed_on and summary["resumes"] == 1 and summary["steps"] == STEPS[recipe]


def _flat(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    flat = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat |= _flat(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            flat[f"{prefix}{key}"] = value
    return flat


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "nproc"), [("timm_imagenet", 2), ("fungitastic", 1)])
def test_make_eval_reads_the_shards_and_gives_the_metrics_the_run_reported(
        recipe: str, nproc: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    import json
    import subprocess
    import sys

    run_dir = trained(recipe, True, 2, tmp_path_factory)
    launcher = [] if nproc == 1 else ["-m", "cluster.torchrun", "--standalone", "--nproc-per-node=2"]
    result = subprocess.run([sys.executable, *launcher, "-m", "common.after_training.evaluate", str(run_dir),
                             "device=cpu"], cwd=REPO, env=recipe_env(), capture_output=True, text=True, timeout=300)
    assert_ok(result)
    report = json.loads((run_dir / "eval-val-latest.json").read_text())
    assert report["world_size"] == nproc
    reported = read_summary(run_dir)["metrics"]
    for name, value in report["metrics"].items():
        assert value == pytest.approx(reported[name], rel=1e-5, abs=1e-6), name
