"""Averaging checkpoints (``make average``, ``common/after_training/average.py``): the average of one checkpoint
is that checkpoint, of two their elementwise mean (of the EMA where kept), BatchNorm's statistics are those of the
averaged weights; eval, export and init_from read it by name, a resume never takes it, and checkpoints of
another model are one line and exit 2."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.swa_utils import update_bn

from common.after_training.average import average_run, average_weights, main
from common.after_training.export import export_run, read_export_weights, read_metadata
from common.after_training.init_from import initialize_model
from common.after_training.trained import checkpoint_weights, open_run, read_state
from common.checkpoint.layout import MANIFEST_FILE, STATE_FILE, file_digest, newest_valid_checkpoint
from common.checkpoint.manager import CheckpointManager
from common.config import config_record
from common.entry import compose_config, typed_config
from common.errors import UserError
from recipes.fashion_mnist.model import build_model
from recipes.fashion_mnist.spec import train_inputs
from recipes.timm_imagenet.data import class_names
from recipes.timm_imagenet.model import build_model as timm_model
from recipes.timm_imagenet.spec import train_inputs as timm_train_inputs
from recipes.tv_segmentation.model import build_model as segmentation_model
from recipes.tv_segmentation.spec import train_inputs as segmentation_train_inputs
from tests.conftest import REPO, assert_ok, recipe_env
from tests.recipe_probe import CPU
from tests.trained_runs import (
    TINY,
    cifar_run,
    dinov2_run,
    evaluate_here,
    fashion_data,
    fashion_pngs,
    fashion_run,
    imagenet_data,
    predict_here,
    voc_data,
)

BN_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def copied(run: Path, tmp_path: Path) -> Path:
    """A copy of a shared run, which the average writes into."""
    return Path(shutil.copytree(run, tmp_path / "run", symlinks=True))


def newest_two(run: Path) -> list[Path]:
    """The two newest checkpoints of ``run``, newest first."""
    manifests = sorted((run / "checkpoints").glob("AtomicDirectory_checkpoint_*/manifest.json"),
                       key=lambda manifest: json.loads(manifest.read_text())["step"], reverse=True)
    return [manifest.parent for manifest in manifests[:2]]


def averaged_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    return read_state(checkpoint)["model"]


def test_the_average_of_one_checkpoint_is_that_checkpoint(tmp_path_factory: pytest.TempPathFactory,
                                                          tmp_path: Path) -> None:
    run = copied(fashion_run(tmp_path_factory), tmp_path)
    written = average_run(run, "last", 1, bn_batches=0)
    assert written == run / "checkpoints" / "average-last-1"
    expected, _ = checkpoint_weights(newest_two(run)[0])
    state = averaged_state(written)
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert state[key].dtype == value.dtype and torch.equal(state[key], value), key


def test_the_average_of_two_is_the_elementwise_mean_of_their_ema(tmp_path_factory: pytest.TempPathFactory,
                                                                tmp_path: Path) -> None:
    run = copied(cifar_run(tmp_path_factory), tmp_path)
    newest, older = (read_state(path)["extra"]["ema"] for path in newest_two(run))
    written = average_run(run, "last", 2, bn_batches=0)
    state = averaged_state(written)
    assert state.keys() == newest.keys()
    for key, value in state.items():
        if value.is_floating_point():
            mean = ((newest[key].double() + older[key].double()) / 2).to(value.dtype)
            assert torch.equal(value, mean), key
        else:  # BatchNorm's counters: the newest checkpoint's
            assert torch.equal(value, newest[key]), key
    assert not torch.equal(state["fc.weight"], newest["fc.weight"]), "the two checkpoints differ"
    manifest = json.loads((written / MANIFEST_FILE).read_text())
    assert manifest["average"]["weights"] == "ema"
    assert manifest["average"]["checkpoints"] == [path.name for path in newest_two(run)]


def test_batchnorm_statistics_are_those_of_the_averaged_weights(tmp_path_factory: pytest.TempPathFactory,
                                                                tmp_path: Path) -> None:
    run = copied(fashion_run(tmp_path_factory), tmp_path)
    mean = averaged_state(average_run(run, "last", 2, bn_batches=0))
    written = average_run(run, "last", 2, bn_batches=3)
    state = averaged_state(written)
    cfg = open_run(run).cfg
    model = build_model(cfg.model)
    model.load_state_dict(mean)
    update_bn(itertools.islice(train_inputs(cfg, CPU), 3), model)
    expected = model.state_dict()
    for key, value in state.items():
        if key.endswith(BN_BUFFERS):
            assert torch.allclose(value.float(), expected[key].float(), rtol=1e-5, atol=1e-6), key
        else:
            assert torch.equal(value, mean[key]), f"{key} is the averaged weight"
    first_bn = next(key for key in state if key.endswith("running_var"))
    assert not torch.allclose(state[first_bn], mean[first_bn]), "the statistics were recomputed"
    assert json.loads((written / MANIFEST_FILE).read_text())["average"]["bn_batches"] == 3


def seeded_checkpoints(cfg: Any, build: Callable[[], torch.nn.Module], folder: Path) -> list[dict[str, torch.Tensor]]:
    """Checkpoints of steps 1 and 2 written as a run writes them, holding the weights ``build`` makes under seeds
    1 and 2 (no training); their states, oldest first."""
    manager = CheckpointManager(folder, keep_last=2)
    states = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        states.append(build().state_dict())
        manager.save(seed, {"model": states[-1]}, config=config_record(cfg))
    return states


def test_a_timm_resnet_gets_batchnorm_statistics_from_its_training_images(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """Two checkpoints written as a run writes them (no training: weights of two seeds), in their folder alone."""
    cfg = typed_config(compose_config("timm_imagenet", [*TINY["timm_imagenet"], f"run_dir={tmp_path / 'run'}",
                                                        f"data.root={imagenet_data(tmp_path_factory)}"]))
    folder = tmp_path / "run" / "checkpoints"
    states = seeded_checkpoints(cfg, lambda: timm_model(cfg.model, len(class_names(cfg.data)), pretrained=False),
                                folder)
    written = average_run(folder, "last", 2, bn_batches=1)
    state = averaged_state(written)
    model = timm_model(cfg.model, len(class_names(cfg.data)), pretrained=False)
    model.load_state_dict(average_weights(states[::-1]))
    update_bn(itertools.islice(timm_train_inputs(cfg, CPU), 1), model)
    assert [key for key in state if key.endswith("running_mean")], "test_resnet has BatchNorm"
    assert len(list(timm_train_inputs(cfg, CPU))) == 24 // 8, "the training split's 24 images, 8 a batch"
    for key, value in model.state_dict().items():
        assert torch.allclose(state[key].float(), value.float(), rtol=1e-5, atol=1e-6), key
    with pytest.raises(UserError, match=r"^the checkpoints of .+ do not fit the model their config builds: .*size"):
        average_run(folder, "last", 2, bn_batches=1, overrides=["model.name=test_efficientnet"])


def test_a_segmentation_model_gets_batchnorm_statistics_from_its_training_images(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """tv_segmentation's DeepLabV3 (BatchNorm in its backbone and head): the same as the timm ResNet above."""
    cfg = typed_config(compose_config("tv_segmentation", [*TINY["tv_segmentation"], f"run_dir={tmp_path / 'run'}",
                                                          f"data.root={voc_data(tmp_path_factory)}"]))
    folder = tmp_path / "run" / "checkpoints"
    states = seeded_checkpoints(cfg, lambda: segmentation_model(cfg.model, pretrained=False), folder)
    written = average_run(folder, "last", 2, bn_batches=2)
    state = averaged_state(written)
    model = segmentation_model(cfg.model, pretrained=False)
    model.load_state_dict(average_weights(states[::-1]))
    torch.manual_seed(cfg.seed)  # the dropout before the head's last BatchNorm draws as the average's did
    update_bn(itertools.islice(segmentation_train_inputs(cfg, CPU), 2), model)
    assert [key for key in state if key.endswith("running_mean")], "DeepLabV3 has BatchNorm"
    assert len(list(segmentation_train_inputs(cfg, CPU))) == 8 // cfg.trainer.batch_size, "8 training images"
    for key, value in model.state_dict().items():
        assert torch.allclose(state[key].float(), value.float(), rtol=1e-5, atol=1e-6), key


def test_eval_export_predict_and_init_from_read_the_average_by_name(tmp_path_factory: pytest.TempPathFactory,
                                                                    tmp_path: Path) -> None:
    run = copied(fashion_run(tmp_path_factory), tmp_path)
    written = average_run(run, "best", 2, bn_batches=2)
    state = averaged_state(written)
    report = evaluate_here("fashion_mnist", run, which="average-best-2")
    assert report["checkpoint"] == str(written.resolve()) and report["which"] == "average-best-2"
    export = export_run(open_run(run, "average-best-2"), tmp_path / "export")
    assert read_metadata(export)["source"]["checkpoint"] == str(written.resolve())
    exported = read_export_weights(export, read_metadata(export))
    assert all(torch.equal(exported[key], value) for key, value in state.items())
    fashion_pngs(fashion_data(tmp_path_factory), tmp_path / "pngs")
    by_name = predict_here(run, tmp_path / "pngs", tmp_path / "by_name", "--which", "average-best-2")
    assert by_name == predict_here(export, tmp_path / "pngs", tmp_path / "from_export")
    cfg = open_run(written).cfg
    model = build_model(cfg.model)
    line = initialize_model(model, cfg.model, "fashion_mnist", str(written), skip_head=False)
    assert str(written) in line
    assert all(torch.equal(model.state_dict()[key], value) for key, value in state.items())


@pytest.mark.slow
def test_dinov2_shards_of_two_ranks_average_into_weights_one_rank_evaluates_sharded_or_whole(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    run = copied(dinov2_run(tmp_path_factory), tmp_path)
    newest, older = (checkpoint_weights(path)[0] for path in newest_two(run))
    written = average_run(run, "last", 2)
    state = averaged_state(written)
    for key, value in state.items():
        assert torch.equal(value, ((newest[key].double() + older[key].double()) / 2).to(value.dtype)), key
    assert json.loads((written / MANIFEST_FILE).read_text())["average"]["bn_batches"] == 0, "no BatchNorm"
    sharded = evaluate_here("dinov2_fsdp", run, "fsdp.on_one_rank=true", which="average-last-2")
    whole = evaluate_here("dinov2_fsdp", run, which="average-last-2")
    assert sharded["metrics"]["eval/loss"] == pytest.approx(whole["metrics"]["eval/loss"], rel=1e-2)


def test_a_resume_never_takes_the_average_and_retention_leaves_it(tmp_path_factory: pytest.TempPathFactory,
                                                                  tmp_path: Path) -> None:
    run = copied(fashion_run(tmp_path_factory), tmp_path)
    written = average_run(run, "last", 2, bn_batches=0)
    folder = run / "checkpoints"
    latest = newest_two(run)[0]
    assert newest_valid_checkpoint(folder)[0] == latest
    assert open_run(run, "latest").checkpoint == latest and open_run(run, "best").checkpoint != written
    manager = CheckpointManager(folder, keep_last=1)
    assert manager.load_latest().path == latest
    manager.save(99, {"model": {}}, {})
    assert written.is_dir() and manager.load_latest().step == 99


def _tamper(checkpoint: Path, change_manifest=None, change_state=None) -> None:
    """Change a checkpoint's config or state and keep its manifest's digests true, so only the change is wrong."""
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    if change_state is not None:
        state = read_state(checkpoint)
        change_state(state["model"])
        torch.save(state, checkpoint / STATE_FILE)
        manifest["files"][STATE_FILE] = {"sha256": file_digest(checkpoint / STATE_FILE),
                                         "size": (checkpoint / STATE_FILE).stat().st_size}
    if change_manifest is not None:
        change_manifest(manifest["config"])
    (checkpoint / MANIFEST_FILE).write_text(json.dumps(manifest))


@pytest.mark.parametrize("change, message", [
    ({"change_manifest": lambda config: config["model"].update(hidden=8)},
     r"has model\.hidden=8 and AtomicDirectory_checkpoint_\w+ model\.hidden=16: average checkpoints of one model"),
    ({"change_manifest": lambda config: config.update(recipe="cifar100_resnet50")},
     r"is a cifar100_resnet50 checkpoint and \w+ a fashion_mnist one"),
    ({"change_state": lambda model: model.update({"0.weight": model["0.weight"][:2]})},
     r"0\.weight is \[2, 1, 3, 3\] in AtomicDirectory_checkpoint_\w+ and \[4, 1, 3, 3\] in"),
    ({"change_state": lambda model: model.pop("0.weight")}, r"has the tensor 0\.weight and \w+ has not"),
], ids=["model-config", "recipe", "shape", "missing-tensor"])
def test_checkpoints_of_another_model_are_one_line_and_exit_2(tmp_path_factory: pytest.TempPathFactory,
                                                             tmp_path: Path, capsys: pytest.CaptureFixture,
                                                             change: dict, message: str) -> None:
    run = copied(fashion_run(tmp_path_factory), tmp_path)
    _tamper(newest_two(run)[1], **change)
    with pytest.raises(SystemExit) as stop:
        main([str(run), "--last", "2", "--bn-batches", "0"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert re.search(message, err), err
    assert not (run / "checkpoints" / "average-last-2").exists()


def test_asking_for_more_checkpoints_than_were_kept_names_the_setting(tmp_path_factory: pytest.TempPathFactory,
                                                                     capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as stop:
        main([str(fashion_run(tmp_path_factory)), "--best", "3"])
    assert stop.value.code == 2
    assert "keeps 2 such checkpoint(s); train with checkpoint.keep_best_k=3" in capsys.readouterr().err


def test_make_average(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    run = copied(fashion_run(tmp_path_factory), tmp_path)
    result = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", "average", f"RUN={run}",
                             "LAST=2", "BN_BATCHES=1"], cwd=REPO, env=recipe_env(), capture_output=True, text=True,
                            timeout=300)
    assert_ok(result)
    written = run / "checkpoints" / "average-last-2"
    assert f"BatchNorm statistics from 1 training batches into {written}" in result.stdout
