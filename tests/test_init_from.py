"""Starting a run from another run's weights (``init_from=``, ``common/after_training/init_from.py``): from a run
of another recipe with the same backbone (the head left out), from an export, a mismatch as one
line naming the tensor, and a resumed run that never reads its ``init_from``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.after_training.export import export_run
from common.after_training.trained import checkpoint_weights, open_run
from common.errors import UserError
from recipes.cifar100_resnet50.model import build_model
from tests.conftest import REPO, assert_ok, recipe_env, run_recipe
from tests.trained_runs import TINY, cifar_run, dinov2_run, fashion_data, fungi_data, summary, timm_run, train_here

FROZEN = ["optim.lr=0", "trainer.max_steps=1"]  # one step that changes no parameter: the weights stay the initial ones


def final_state(run: Path) -> dict:
    return torch.load(open_run(run).checkpoint / "state.pt", map_location="cpu", weights_only=True)


def test_fungitastic_starts_from_a_timm_imagenet_run_of_the_same_backbone(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    source = timm_run(tmp_path_factory)
    source_ema = final_state(source)["extra"]["ema"]  # what the source offers: its EMA of the weights
    data = fungi_data(tmp_path_factory)
    with pytest.raises(UserError, match=r"heads\.species\.weight is \[3, 64\] there and \[4, 64\] here; "
                                        r"init_skip_head=true leaves the classifier head out"):
        train_here("fungitastic", tmp_path / "with_head", f"data.root={data}", f"init_from={source}", *FROZEN)

    run = tmp_path / "run"
    result = train_here("fungitastic", run, f"data.root={data}", f"init_from={source}", "init_skip_head=true",
                        *FROZEN)
    assert result["init_from"] == str(source)
    assert f"initialized from the ema weights of {open_run(source).checkpoint}" in capsys.readouterr().out
    model = final_state(run)["model"]
    backbone = {key.removeprefix("backbone."): value for key, value in model.items() if key.startswith("backbone.")}
    assert backbone.keys() == {key for key in source_ema if not key.startswith("head.")}
    for key, value in backbone.items():
        assert torch.equal(value, source_ema[key]), key
    assert model["heads.species.weight"].shape[0] == 4, "the heads are this run's own, for its classes"


def test_cifar100_starts_from_its_own_export(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    source = cifar_run(tmp_path_factory)
    export = export_run(open_run(source), tmp_path / "export")
    exported = load_file(export / "model.safetensors")
    cfg = open_run(source).cfg
    run = tmp_path / "run"
    train_here("cifar100_resnet50", run, f"data.root={cfg.data.root}", f"init_from={export}", "ema.enabled=true",
               *FROZEN)
    state = final_state(run)
    for name, _ in build_model(cfg.model).named_parameters():  # (BatchNorm's running statistics move with the one step)
        assert torch.equal(state["model"][name], exported[name]), name
        assert torch.equal(state["extra"]["ema"][name], exported[name]), f"the EMA starts from them too: {name}"
    assert summary(run)["init_from"] == str(export)


def test_a_resumed_run_ignores_init_from(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    data = fashion_data(tmp_path_factory)
    nowhere = tmp_path / "nowhere"
    with pytest.raises(UserError, match=f"init_from={nowhere}: {nowhere} does not exist"):
        train_here("fashion_mnist", tmp_path / "fresh", f"data.root={data}", f"init_from={nowhere}")

    run = tmp_path / "run"
    train_here("fashion_mnist", run, f"data.root={data}", "trainer.epochs=1")
    resumed = train_here("fashion_mnist", run, f"data.root={data}", "trainer.epochs=2", f"init_from={nowhere}")
    assert f"init_from={nowhere} ignored: the run resumed from its own checkpoint" in capsys.readouterr().out
    assert resumed["resumes"] == 1 and resumed["epochs"] == 2
    assert "init_from" not in resumed, "the summary names the weights the run started from: none here"


def test_mismatched_shapes_are_one_line_naming_the_first_tensor(tmp_path_factory: pytest.TempPathFactory,
                                                                tmp_path: Path) -> None:
    source = cifar_run(tmp_path_factory)
    result = subprocess.run(
        [sys.executable, "-m", "recipes.cifar100_resnet50.train", f"run_dir={tmp_path / 'run'}",
         f"data.root={open_run(source).cfg.data.root}", *TINY["cifar100_resnet50"], "model.name=resnet18",
         f"init_from={source}"], cwd=REPO, env=recipe_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: init_from={source} does not fit this model: conv1.weight is [32, 3, 3, 3] there and "
        f"[64, 3, 3, 3] here"]


@pytest.mark.slow
def test_dinov2_on_two_fsdp_ranks_starts_from_the_export_of_a_sharded_run(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    source = open_run(dinov2_run(tmp_path_factory))
    export = export_run(source, tmp_path / "export")
    run = tmp_path / "run"
    result = run_recipe("dinov2_fsdp", [f"run_dir={run}", f"data.root={source.cfg.data.root}",
                                        f"model.weights={source.cfg.model.weights}", *TINY["dinov2_fsdp"], *FROZEN,
                                        f"init_from={export}"], nproc=2)
    assert_ok(result)
    assert f"initialized from the model weights of the dinov2_fsdp export {export}" in result.stdout
    started, _ = checkpoint_weights(open_run(run).checkpoint)  # every rank's shards, gathered
    expected, _ = checkpoint_weights(source.checkpoint)
    assert started.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(started[key], value), key
