"""The Strong Compute ISC: every .isc file is a valid experiment; a run resumes from what the ISC's
Checkpoint Artifacts ship; `make isc-rehearse` models that sync across SIGKILL cycles.

What an ISC sync ships, by Strong Compute's Artifacts page and cycling_utils' AtomicDirectory
docstring: the checkpoint directory that ``<name>.latest_checkpoint`` points at and every directory
whose name ends in ``_force``; the other checkpoints written since the previous sync are deleted.
The next cycle finds them in ``CHECKPOINT_ARTIFACT_PATH``, which may be another path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from common.checkpoint.layout import checkpoint_dirs, committed_checkpoints
from common.checkpoint.manager import KEEP_ALL, CheckpointManager
from common.errors import UserError
from tests.conftest import assert_ok, kill_run, latest_step, read_summary, recipe_env, run_recipe, start_recipe
from tests.resume import paused_env, wait_for_pause
from tools.isc_rehearse import COMPUTE_MODES, load_experiment, sync_checkpoints
from tools.tiny_data import write_fashion_mnist

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.parent.name for p in (REPO / "recipes").glob("*/train.py"))
ISC_FILES = sorted((REPO / "cluster" / "isc").glob("*.isc"))
FASHION_ISC = (REPO / "cluster" / "isc" / "fashion_mnist.isc").read_text()

# Paces training steps (0.15 s per loss computation) so that a rehearsal's cycles of a few seconds
# hold a known amount of training, on a fast machine as on a slow one; the recipe is unchanged.
PACE_STEPS = """\
import time
import torch.nn.functional as functional

_cross_entropy = functional.cross_entropy


def _paced_cross_entropy(*args, **kwargs):
    time.sleep(0.15)
    return _cross_entropy(*args, **kwargs)


functional.cross_entropy = _paced_cross_entropy
"""


def paced(tmp_path: Path) -> str:
    """A PYTHONPATH entry whose sitecustomize paces the steps."""
    pace = tmp_path / "pace"
    pace.mkdir(exist_ok=True)
    (pace / "sitecustomize.py").write_text(PACE_STEPS)
    return str(pace)


def test_every_recipe_has_an_isc_file():
    assert "fashion_mnist" in RECIPES
    assert sorted(path.stem for path in ISC_FILES) == RECIPES


@pytest.mark.parametrize("path", ISC_FILES, ids=lambda p: p.name)
def test_isc_file_has_current_keys_a_documented_mode_and_keeps_only_checkpoints_in_the_artifact_path(path: Path):
    text = path.read_text()
    fields = tomllib.loads(text)
    assert {"isc_project_id", "experiment_name", "gpus", "compute_mode", "dataset_id_list", "command"} == set(fields)
    assert fields["compute_mode"] in COMPUTE_MODES
    comments = " ".join(line for line in text.splitlines() if line.startswith("#"))
    assert f'compute_mode = "{fields["compute_mode"]}"' in comments, "the comment says which mode and why"
    assert isinstance(fields["gpus"], int) and fields["gpus"] > 0
    command = fields["command"]
    for variable in ("$NNODES", "$N_PROC", "$MASTER_ADDR", "$MASTER_PORT", "$NODE_RANK"):
        assert variable in command, variable
    assert "checkpoint.dir=$CHECKPOINT_ARTIFACT_PATH" in command and "run_dir=$LOSSY_ARTIFACT_PATH" in command
    assert "run_dir=$CHECKPOINT_ARTIFACT_PATH" not in command
    assert "python -m cluster.torchrun " in command, "torchrun with the exit codes of one process (cluster/README.md)"
    recipe = re.search(r"-m recipes\.(\w+)\.train", command).group(1)
    assert recipe == path.stem and (REPO / "recipes" / recipe / "train.py").is_file()
    assert [f"/data/{dataset}" for dataset in fields["dataset_id_list"]][0] in command
    assert load_experiment(path).recipe == recipe  # the rehearsal's own checker agrees


@pytest.mark.parametrize(("change", "message"), [
    (lambda text: text.replace('compute_mode = "cycle"', 'compute_mode = "fast"'), "compute_mode must be one of"),
    (lambda text: text.replace("recipes.fashion_mnist.train", "recipes.no_such_recipe.train"), "no_such_recipe"),
    (lambda text: text.replace("$NODE_RANK", "0"), "does not use $NODE_RANK"),
    (lambda text: text.replace("isc_project_id", "project"), "isc_project_id is missing"),
    (lambda text: text.replace("/data/fashion-mnist-dataset-id", "/data/other-id"), "not in dataset_id_list"),
])
def test_isc_checker_rejects_a_broken_file(tmp_path: Path, change, message: str):
    broken = tmp_path / "broken.isc"
    broken.write_text(change(FASHION_ISC))
    with pytest.raises(UserError, match=re.escape(message)):
        load_experiment(broken)


@pytest.mark.parametrize("mode", [*COMPUTE_MODES, None])
def test_isc_checker_accepts_every_documented_mode_and_no_dataset_list(tmp_path: Path, mode: str | None):
    text = FASHION_ISC.replace('dataset_id_list = ["fashion-mnist-dataset-id"]\n', "")
    text = text.replace("/data/fashion-mnist-dataset-id", "data/fashion_mnist")
    mode_line = f'compute_mode = "{mode}"\n' if mode else ""
    text = text.replace('compute_mode = "cycle"\n', mode_line)
    path = tmp_path / "variant.isc"
    path.write_text(text)
    assert load_experiment(path).compute_mode == (mode or "cycle")


def state_for(step: int) -> dict:
    return {"step": step}


def test_the_rehearsal_ships_what_the_isc_ships(tmp_path: Path):
    live, store = tmp_path / "node", tmp_path / "store"
    manager = CheckpointManager(live, keep_last=KEEP_ALL, best_metric="eval/top1")
    manager.save(1, state_for(1), {"eval/top1": 0.5})  # 0_force, the best
    manager.save(2, state_for(2))
    manager.save(3, state_for(3), milestone="end of stage 1")  # 2_force
    manager.save(4, state_for(4))
    shipped = sync_checkpoints(live, store)
    assert shipped.name == "AtomicDirectory_checkpoint_3" and shipped.step == 4
    assert sorted(path.name for path in store.iterdir()) == [
        "AtomicDirectory.latest_checkpoint", "AtomicDirectory_checkpoint_0_force", "AtomicDirectory_checkpoint_2_force",
        "AtomicDirectory_checkpoint_3"]
    assert "AtomicDirectory_checkpoint_1" not in {path.name for path in live.iterdir()}, "the ISC deletes the rest"

    manager.save(5, state_for(5))
    assert sync_checkpoints(live, store).step == 5
    assert "AtomicDirectory_checkpoint_3" in {path.name for path in store.iterdir()}, "shipped artifacts stay"
    assert "AtomicDirectory_checkpoint_3" not in {path.name for path in live.iterdir()}


# ---- a run resumes from what the ISC ships ------------------------------------------------------

RECIPE = "fashion_mnist"
TINY = ["model.channels=[4,8]", "model.hidden=16", "trainer.batch_size=16", "logging.backend=none",
        "logging.progress_bar=false", "checkpoint.every_seconds=0"]
SETTINGS = ["trainer.epochs=4", "checkpoint.every_steps=1", "data.random_crop_padding=2", "data.horizontal_flip=true",
            "seed=7"]


def on_isc(data: Path, node: Path) -> tuple[list[str], dict[str, str]]:
    """The overrides and environment of an .isc command whose artifacts are in ``node``."""
    overrides = [f"data.root={data}", f"checkpoint.dir={node / 'checkpoints'}", f"run_dir={node / 'lossy'}", *TINY,
                 *SETTINGS]
    env = {"CHECKPOINT_ARTIFACT_PATH": str(node / "checkpoints"), "LOSSY_ARTIFACT_PATH": str(node / "lossy")}
    return overrides, env


def ship(node: Path, store: Path) -> None:
    """What an ISC sync keeps, by the documented rules, written out here independently of the rehearsal."""
    store.mkdir(parents=True)
    link = node / "AtomicDirectory.latest_checkpoint"
    latest = Path(os.readlink(link)).name
    for path in node.iterdir():
        if path.is_dir() and not path.is_symlink() and (path.name == latest or path.name.endswith("_force")):
            shutil.copytree(path, store / path.name)
    os.symlink(os.readlink(link), store / link.name)


@pytest.mark.slow
def test_a_run_stopped_mid_epoch_resumes_from_what_the_isc_ships_at_another_path(fashion_data: Path,
                                                                               tmp_path: Path) -> None:
    """Two processes; one process's cycles are test_make_isc_rehearse_... and test_search's ISC test."""
    nproc = 2
    reference = tmp_path / "reference"
    assert_ok(run_recipe(RECIPE, [f"data.root={fashion_data}", f"run_dir={reference}", *TINY, *SETTINGS],
                         nproc=nproc))
    steps_per_epoch = read_summary(reference)["steps"] // 4

    node = tmp_path / "cycle-1"
    overrides, isc_env = on_isc(fashion_data, node)
    killed_at = steps_per_epoch + steps_per_epoch // 2  # mid-epoch 2: the run pauses right after it
    process = start_recipe(RECIPE, overrides, nproc=nproc, env=paused_env(killed_at, tmp_path / "paused", **isc_env))
    wait_for_pause(tmp_path / "paused", process)
    kill_run(process)
    assert latest_step(node / "checkpoints") == killed_at
    best = [found for found in committed_checkpoints(node / "checkpoints") if "eval/top1" in found.metrics]
    assert len(best) == 1 and best[0].force, "the epoch-1 checkpoint, the best so far, is _force"

    elsewhere = tmp_path / "restored"
    ship(node / "checkpoints", elsewhere / "checkpoints")
    shutil.rmtree(node)  # the node and everything else on it is gone
    assert {path.name for path in (elsewhere / "checkpoints").iterdir()} >= {best[0].path.name}

    overrides, isc_env = on_isc(fashion_data, elsewhere)
    result = run_recipe(RECIPE, overrides, nproc=nproc, env=recipe_env(**isc_env))
    assert_ok(result)
    assert f"resumed from {elsewhere / 'checkpoints'}/AtomicDirectory_checkpoint_" in result.stdout
    assert f"(step {killed_at}," in result.stdout
    resumed, uninterrupted = read_summary(elsewhere / "lossy"), read_summary(reference)
    assert resumed["resumes"] == 1 and resumed["steps"] == uninterrupted["steps"]
    assert resumed["model_digest"] == uninterrupted["model_digest"]
    assert (elsewhere / "lossy" / ".hydra" / "config.yaml").is_file()
    assert {path.name for path in (elsewhere / "checkpoints").iterdir() if path.is_dir()} >= {best[0].path.name}, \
        "on the ISC the recipe deletes no checkpoint: the ISC does"


# ---- make isc-rehearse -------------------------------------------------------------------------

CYCLE_ROW = re.compile(
    r"^\s*(\d+)\s+(killed|exited \d+) after \d+ s\s+(-|step \d+)\s+(\S+)\s+(-|step \d+)\s+(-|[\d.]+ s)$", re.MULTILINE
)


def rehearse(tmp_path: Path, data: Path, work: Path, cycles: int, cycle_s: str, *extra: str
             ) -> subprocess.CompletedProcess:
    args = (f"--data {data} --nproc 1 --work-dir {work} --finish-timeout 400 {' '.join(extra)} -- "
            "trainer.max_steps=200 trainer.epochs=100 trainer.batch_size=8 checkpoint.every_seconds=2 "
            "model.channels=[4,8] model.hidden=16 logging.backend=none")
    env = recipe_env(PYTHONPATH=paced(tmp_path))
    # -o: treat the venv stamp as up to date, so make never reinstalls anything here.
    return subprocess.run(["make", "-s", "-o", ".venv/.installed", "isc-rehearse", f"PY={sys.executable}",
                           "RECIPE=fashion_mnist", f"CYCLES={cycles}", f"CYCLE_S={cycle_s}", f"ARGS={args}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_make_isc_rehearse_resumes_each_cycle_from_what_was_shipped_and_finishes(tmp_path: Path):
    data = write_fashion_mnist(tmp_path / "data")
    work = tmp_path / "rehearsal"
    result = rehearse(tmp_path, data, work, 2, "30", "--sync-seconds", "5")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = CYCLE_ROW.findall(result.stdout)  # (cycle, outcome, resumed from, shipped, its step, work lost)
    assert rows[0][1] == "killed" and rows[-1][1] == "exited 0", result.stdout
    # Every cycle after a kill resumed from exactly what the ISC had shipped at the previous one's end.
    for before, after in zip(rows, rows[1:]):
        assert after[2] == before[4] != "-", result.stdout
        assert before[3].startswith("AtomicDirectory_checkpoint_"), result.stdout
    store = work / "artifacts"
    summary = json.loads((store / "lossy" / "summary.json").read_text())
    assert summary["steps"] == 200 and summary["resumes"] == sum(row[1] == "killed" for row in rows)
    assert f"finished after {len(rows)} cycle(s): 200 steps" in result.stdout
    # The store holds only what the ISC ships (the latest checkpoint at each sync, the _force ones),
    # not every checkpoint the run wrote (N counts every save).
    shipped = checkpoint_dirs(store / "checkpoints")
    assert rows[-1][3] in {found.path.name for found in shipped}
    assert len(shipped) < shipped[-1].index + 1, [found.path.name for found in shipped]
    assert not any(path.name.startswith("cycle-") and path.is_dir() for path in work.iterdir()), \
        "every cycle's node-local folders are gone"


def test_a_cycle_shorter_than_the_first_checkpoint_is_reported_as_no_progress(tmp_path: Path):
    data = write_fashion_mnist(tmp_path / "data")
    result = rehearse(tmp_path, data, tmp_path / "rehearsal", 1, "1")
    assert result.returncode != 0
    assert "cycle 1 made no progress in 1 s (the ISC shipped nothing)" in result.stderr
    assert CYCLE_ROW.findall(result.stdout)[0][1:5] == ("killed", "-", "-", "-"), result.stdout
