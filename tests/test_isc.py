"""cluster/isc: every .isc file is a valid experiment, and `make isc-rehearse` survives SIGKILL cycles."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from cluster.isc.rehearse import load_experiment
from common.errors import UserError
from tools.tiny_data import write_fashion_mnist

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.parent.name for p in (REPO / "recipes").glob("*/train.py"))
ISC_FILES = sorted((REPO / "cluster" / "isc").glob("*.isc"))


def test_every_recipe_has_an_isc_file():
    assert "fashion_mnist" in RECIPES
    assert sorted(path.stem for path in ISC_FILES) == RECIPES


@pytest.mark.parametrize("path", ISC_FILES, ids=lambda p: p.name)
def test_isc_file_is_toml_with_the_required_keys_and_a_runnable_command(path: Path):
    fields = tomllib.loads(path.read_text())
    assert {"isc_project_id", "experiment_name", "gpus", "compute_mode", "dataset_id_list", "command"} <= set(fields)
    assert fields["compute_mode"] in ("cycle", "burst")
    assert isinstance(fields["gpus"], int) and fields["gpus"] > 0
    command = fields["command"]
    for variable in ("$NNODES", "$N_PROC", "$MASTER_ADDR", "$MASTER_PORT", "$NODE_RANK", "$CHECKPOINT_ARTIFACT_PATH"):
        assert variable in command, variable
    recipe = re.search(r"-m recipes\.(\w+)\.train", command).group(1)
    assert recipe == path.stem and (REPO / "recipes" / recipe / "train.py").is_file()
    assert [f"/data/{dataset}" for dataset in fields["dataset_id_list"]][0] in command
    assert load_experiment(path).recipe == recipe  # the rehearsal's own checker agrees


@pytest.mark.parametrize(("change", "message"), [
    (lambda text: text.replace('compute_mode = "cycle"', 'compute_mode = "fast"'), "compute_mode must be"),
    (lambda text: text.replace("recipes.fashion_mnist.train", "recipes.no_such_recipe.train"), "no_such_recipe"),
    (lambda text: text.replace("$NODE_RANK", "0"), "does not use $NODE_RANK"),
    (lambda text: text.replace("isc_project_id", "project"), "isc_project_id is missing"),
    (lambda text: text.replace("/data/fashion-mnist-dataset-id", "/data/other-id"), "not in dataset_id_list"),
])
def test_isc_checker_rejects_a_broken_file(tmp_path: Path, change, message: str):
    broken = tmp_path / "broken.isc"
    broken.write_text(change((REPO / "cluster" / "isc" / "fashion_mnist.isc").read_text()))
    with pytest.raises(UserError, match=re.escape(message)):
        load_experiment(broken)


CYCLE_ROW = re.compile(r"^\s*\d+\s+(killed|exited \d+) after \d+ s\s+(-|step \d+)\s+(-|step \d+)", re.MULTILINE)

# Paces training steps (0.15 s per loss computation) so that a 30 s cycle ends mid-run on a
# fast machine as on a slow one; the rehearsal itself and the recipe are unchanged.
PACE_STEPS = """\
import time
import torch.nn.functional as functional

_cross_entropy = functional.cross_entropy


def _paced_cross_entropy(*args, **kwargs):
    time.sleep(0.15)
    return _cross_entropy(*args, **kwargs)


functional.cross_entropy = _paced_cross_entropy
"""


@pytest.mark.slow
def test_make_isc_rehearse_survives_sigkill_cycles_and_finishes(tmp_path: Path):
    data = write_fashion_mnist(tmp_path / "data")
    pace = tmp_path / "pace"
    pace.mkdir()
    (pace / "sitecustomize.py").write_text(PACE_STEPS)
    work = tmp_path / "rehearsal"
    args = (f"--data {data} --nproc 1 --work-dir {work} --finish-timeout 400 -- trainer.max_steps=200 "
            "trainer.epochs=100 trainer.batch_size=8 checkpoint.every_seconds=2 model.channels=[4,8] "
            "model.hidden=16 logging.backend=none")
    env = {key: value for key, value in os.environ.items()
           if key not in ("CHECKPOINT_ARTIFACT_PATH", "LOSSY_ARTIFACT_PATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(pace))
    # -o: treat the venv stamp as up to date, so make never reinstalls anything here.
    result = subprocess.run(["make", "-s", "-o", ".venv/.installed", "isc-rehearse", f"PY={sys.executable}",
                             "RECIPE=fashion_mnist", "CYCLES=2", "CYCLE_S=30", f"ARGS={args}"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)

    assert result.returncode == 0, result.stdout + result.stderr
    rows = CYCLE_ROW.findall(result.stdout)  # (outcome, resumed from, newest checkpoint) per cycle
    assert rows[0][0] == "killed", result.stdout  # the first cycle ended by SIGKILL, mid-run
    assert rows[-1][0] == "exited 0", result.stdout
    # Every cycle after a kill resumed from exactly the newest checkpoint the kill left.
    for before, after in zip(rows, rows[1:]):
        assert after[1] == before[2] != "-", result.stdout
    summary = json.loads((work / "checkpoints" / "summary.json").read_text())
    assert summary["steps"] == 200
    assert summary["resumes"] == sum(1 for row in rows if row[0] == "killed")
    assert f"finished after {len(rows)} cycle(s): 200 steps" in result.stdout
