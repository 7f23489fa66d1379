"""Hyperparameter search (tools/search, common/run/search_trial.py): trials are ordinary runs that
resume, workers share a study with no batch barrier, pruning through the run contract, failures
recorded, results that agree with the trials' own summaries (the SLURM array:
tests/test_search_slurm.py).

Every worker is a real ``python -m tools.search`` process, every trial a real run of the recipe.
Where a test needs a trial interrupted, the trial's run pauses at a chosen checkpoint
(tests/pause_hook, PAUSE_ONLY_IN naming the trial's folder), so the kill or the signal lands
there however fast the machine is; every wait has a deadline of minutes and no test asserts a
duration.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.errors import EXIT_PREEMPTED
from common.run_lock import LOCK_FILE
from tests.conftest import REPO, assert_ok, kill_run, latest_step, read_summary, recipe_env, run_recipe
from tests.resume import CHAIN_SETTINGS, paused_env, wait_for_pause
from tests.trained_runs import TINY, fashion_data

DEADLINE_S = 600
FASHION_SPACE = """
pruner: none
params:
  optim.lr: {type: float, low: 1.0e-3, high: 1.0e-2, log: true}
  optim.name: {type: choice, values: [adamw, sgd]}
"""


def fashion_overrides(factory: pytest.TempPathFactory, *extra: str) -> list[str]:
    return [f"data.root={fashion_data(factory)}", *TINY["fashion_mnist"], "trainer.batch_size=32",
            "trainer.epochs=2", *extra]


def write_space(folder: Path, text: str) -> Path:
    path = folder / "space.yaml"
    path.write_text(text)
    return path


def search_command(recipe: str, space: Path, study: Path, trials: int, overrides: list[str],
                   *options: str) -> list[str]:
    return [sys.executable, "-m", "tools.search", recipe, "--space", str(space), "--trials", str(trials),
            "--study", str(study), *options, "--", *overrides]


def start_worker(command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """A worker in a session of its own (``kill_run`` then ends it, its trial's run and everything below)."""
    return subprocess.Popen(command, cwd=REPO, env=env or recipe_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(worker: subprocess.Popen) -> str:
    """Wait for a worker; its output."""
    try:
        return worker.communicate(timeout=DEADLINE_S)[0]
    except subprocess.TimeoutExpired:
        kill_run(worker)
        pytest.fail(f"the worker did not finish within {DEADLINE_S} s:\n{worker.communicate()[0][-4000:]}")


def run_worker(command: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, env=env or recipe_env(), capture_output=True, text=True,
                          timeout=DEADLINE_S)


def study_json(study: Path) -> dict:
    return json.loads((study / "study.json").read_text())


def started(output: str) -> list[int]:
    """The trials a worker's output says it started fresh."""
    return [int(number) for number in re.findall(r"^search: trial (\d+): starting in", output, re.MULTILINE)]


def resumed(output: str) -> list[int]:
    return [int(number) for number in re.findall(r"^search: trial (\d+): resuming in", output, re.MULTILINE)]


def claim_holder(study: Path, number: int) -> dict:
    return json.loads((study / "claims" / f"trial_{number}" / LOCK_FILE).read_text())


def trained_alone(recipe: str, overrides: list[str], trial: dict, run_dir: Path) -> dict:
    """The summary of trial ``trial``'s parameters trained without a search, uninterrupted."""
    params = [f"{key}={value!r}" if isinstance(value, float) else f"{key}={value}"
              for key, value in trial["params"].items()]
    assert_ok(run_recipe(recipe, [*overrides, *params, f"run_dir={run_dir}"]))
    return read_summary(run_dir)


# ---- a bad space: one line, exit 2, before any trial -------------------------------------------

BAD_SPACES = {
    "a key the schema lacks": ("params:\n  optim.lrr: {type: float, low: 0.001, high: 0.01}\n",
                               "params.optim.lrr = 0.001: Could not override 'optim.lrr'"),
    "a value of the wrong type": ("params:\n  trainer.batch_size: {type: float, low: 16.5, high: 64.0}\n",
                                  "params.trainer.batch_size = 16.5:"),
    "a choice the schema refuses": ("params:\n  optim.name: {type: choice, values: [adamw, lion]}\n",
                                    "params.optim.name = 'lion':"),
    "low above high": ("params:\n  optim.lr: {type: float, low: 0.1, high: 0.01}\n",
                       "params.optim.lr: low (0.1) must be below high (0.01)"),
    "a log range from 0": ("params:\n  optim.lr: {type: float, low: 0.0, high: 0.01, log: true}\n",
                           "params.optim.lr: a log range must start above 0"),
    "an int range off its step": ("params:\n  trainer.batch_size: {type: int, low: 16, high: 60, step: 16}\n",
                                  "high (60) must be low (16) plus a multiple of step (16)"),
    "an unknown field": ("params:\n  optim.lr: {type: float, low: 0.001, high: 0.01, scale: log}\n",
                         "params.optim.lr: unknown field scale"),
    "the run directory": ("params:\n  run_dir: {type: choice, values: [a, b]}\n",
                          "params.run_dir: the search sets run_dir for each trial"),
    "a bad direction": ("objective: {metric: eval/top1, direction: up}\nparams:\n"
                        "  optim.lr: {type: float, low: 0.001, high: 0.01}\n",
                        "objective.direction must be max or min"),
    "an unknown pruner": ("pruner: patient\nparams:\n  optim.lr: {type: float, low: 0.001, high: 0.01}\n",
                          "pruner 'patient' is not one of median, halving, hyperband, none"),
    "a pruner option it lacks": ("pruner: {name: median, warmup: 3}\nparams:\n"
                                 "  optim.lr: {type: float, low: 0.001, high: 0.01}\n",
                                 "pruner median has no option warmup"),
}


@pytest.mark.parametrize("case", BAD_SPACES, ids=lambda case: case.replace(" ", "-"))
def test_a_bad_space_is_one_line_and_exit_2_before_any_trial(case: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    from tools.search.__main__ import main

    text, message = BAD_SPACES[case]
    space = write_space(tmp_path, text)
    with pytest.raises(SystemExit) as stop:
        main(["fashion_mnist", "--space", str(space), "--trials", "2", "--study", str(tmp_path / "study")])
    assert stop.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {space}: ") and message in lines[0], lines
    assert not (tmp_path / "study").exists()


def test_make_search_with_a_key_the_recipe_lacks_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    """Through make and a real process (cifar100_resnet50: its target has no data-prep step)."""
    space = write_space(tmp_path, "params:\n  optim.momentun: {type: float, low: 0.8, high: 0.99}\n")
    result = subprocess.run(["make", "-s", "-o", ".venv/.installed", "search-cifar100_resnet50", f"PY={sys.executable}",
                             f"SPACE={space}", "TRIALS=2", f"STUDY={tmp_path / 'study'}", "ARGS=trainer.epochs=1"],
                            cwd=REPO, env=recipe_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    ours = [line for line in result.stderr.splitlines() if not re.match(r"make(\[\d+\])?: \*\*\*", line)]
    assert ours == [f"error: {space}: params.optim.momentun = 0.8: Could not override 'optim.momentun': "
                    f"Key 'momentun' not in 'OptimConfig'"], result.stderr
    assert "Traceback" not in result.stdout + result.stderr and not (tmp_path / "study").exists()


def test_overrides_that_set_a_trials_run_directory_or_a_tuned_key_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from tools.search.__main__ import main

    space = write_space(tmp_path, FASHION_SPACE)
    for overrides, message in ((["name=mine"], "name=mine: the search sets name for each trial"),
                               (["optim.lr=0.1"], "params.optim.lr is also set by the overrides")):
        with pytest.raises(SystemExit) as stop:
            main(["fashion_mnist", "--space", str(space), "--trials", "1", "--study", str(tmp_path / "s"), "--",
                  *overrides])
        assert stop.value.code == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert message in line


def test_pruners_by_name_and_a_bad_option_is_one_line() -> None:
    import optuna

    from common.errors import UserError
    from common.run.search_trial import make_pruner

    assert isinstance(make_pruner({"name": "median", "n_startup_trials": 1}), optuna.pruners.MedianPruner)
    assert isinstance(make_pruner({"name": "halving"}), optuna.pruners.SuccessiveHalvingPruner)
    assert isinstance(make_pruner({"name": "hyperband", "min_resource": 1}), optuna.pruners.HyperbandPruner)
    assert isinstance(make_pruner({"name": "none"}), optuna.pruners.NopPruner)
    with pytest.raises(UserError, match="pruner median: Number of startup trials cannot be negative"):
        make_pruner({"name": "median", "n_startup_trials": -1})


# ---- two workers at once ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two workers started at once on one study of 4 trials; both left to finish."""
    tmp = tmp_path_factory.mktemp("two_workers")
    study, overrides = tmp / "study", fashion_overrides(tmp_path_factory)
    command = search_command("fashion_mnist", write_space(tmp, FASHION_SPACE), study, 4, overrides)
    workers = [start_worker(command) for _ in range(2)]
    outputs = [finish(worker) for worker in workers]
    return {"study": study, "codes": [worker.returncode for worker in workers], "outputs": outputs,
            "overrides": overrides}


@pytest.mark.slow
def test_two_workers_at_once_finish_the_trials_asked_for_and_run_none_twice(two_workers: dict) -> None:
    outputs, study = two_workers["outputs"], two_workers["study"]
    assert two_workers["codes"] == [0, 0], "\n\n".join(outputs)
    runs = started(outputs[0]) + started(outputs[1])
    assert sorted(runs) == [0, 1, 2, 3], runs  # each trial started once, by one worker
    assert resumed(outputs[0]) + resumed(outputs[1]) == []
    record = study_json(study)
    assert [trial["trial"] for trial in record["trials"]] == [0, 1, 2, 3]  # no trial asked for beyond 4
    assert record["counts"] == {"complete": 4}
    for trial in record["trials"]:
        summary = read_summary(Path(trial["run_dir"]))
        assert summary["resumes"] == 0 and summary["steps"] == 16
        assert trial["value"] == summary["metrics"]["eval/top1"]


def test_the_studys_best_is_the_best_of_the_trials_own_summaries(two_workers: dict) -> None:
    study = two_workers["study"]
    record = study_json(study)
    values = {number: read_summary(study / f"trial_{number}")["metrics"]["eval/top1"] for number in range(4)}
    best = max(values, key=lambda number: (values[number], -number))  # the first of equals, as Optuna
    assert record["best"] == {"trial": best, "value": values[best], "params": record["trials"][best]["params"],
                              "run_dir": str(study / f"trial_{best}")}
    config = (study / f"trial_{best}" / ".hydra" / "config.yaml").read_text()
    assert f"lr: {record['best']['params']['optim.lr']}" in config  # the run trained with those parameters
    assert f"name: {record['best']['params']['optim.name']}" in config


def test_a_report_prints_every_trial_and_draws_the_plots(two_workers: dict) -> None:
    study = two_workers["study"]
    (study / "study.json").unlink()
    result = run_worker([sys.executable, "-m", "tools.search", "fashion_mnist", "--study", str(study), "--report"])
    assert_ok(result)
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"\d+\s+complete\s", line)]
    assert sorted(int(row[0]) for row in rows) == [0, 1, 2, 3]
    best = study_json(study)["best"]["trial"]
    assert [row[-1] for row in rows if int(row[0]) == best] == ["best"]
    for plot in ("optimization_history.png", "param_importances.png"):
        assert (study / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot


# ---- pre-emption loses nothing ---------------------------------------------------------------


@pytest.mark.slow
def test_a_worker_stopped_mid_trial_leaves_it_to_the_next_worker_while_the_other_goes_on(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Trial 0 pauses after its step-2 checkpoint in whichever worker takes it; the other worker
    runs trials 1 and 2 meanwhile (no batch barrier) and ends, leaving trial 0 to its holder. SIGTERM
    to the holder: the trial checkpoints, the worker exits 75, and a new worker resumes the trial.
    (That a resumed trial ends as if never stopped: the SIGKILL and ISC tests below.)"""
    study, overrides = tmp_path / "study", fashion_overrides(tmp_path_factory, *CHAIN_SETTINGS)
    command = search_command("fashion_mnist", write_space(tmp_path, FASHION_SPACE), study, 3, overrides)
    marker = tmp_path / "paused"
    env = paused_env(2, marker, PAUSE_ONLY_IN=f"{os.sep}trial_0{os.sep}")
    workers = [start_worker(command, env) for _ in range(2)]
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not marker.exists():
            assert all(worker.poll() is None for worker in workers), [finish(worker) for worker in workers]
            assert time.monotonic() < deadline, "trial 0 did not reach its step-2 checkpoint"
            time.sleep(0.1)
        holder_pid = claim_holder(study, 0)["pid"]
        (holder,) = [worker for worker in workers if worker.pid == holder_pid]
        (other,) = [worker for worker in workers if worker is not holder]
        other_output = finish(other)
        assert other.returncode == 0, other_output
        assert sorted(started(other_output)) == [1, 2] and resumed(other_output) == [], other_output
        assert "nothing left for this worker: trial(s) 0 run elsewhere" in other_output
        assert holder.poll() is None  # still holding trial 0, paused

        holder.send_signal(signal.SIGTERM)
        holder_output = finish(holder)
    finally:
        for worker in workers:
            if worker.poll() is None:
                kill_run(worker)
    assert holder.returncode == EXIT_PREEMPTED, holder_output
    assert started(holder_output) == [0]
    assert "received SIGTERM: checkpoint saved at step 3" in holder_output
    assert "trial 0: stopped after its checkpoint (exit 75); it stays in the study" in holder_output
    record = study_json(study)
    assert [trial["state"] for trial in record["trials"]] == ["running", "complete", "complete"]
    assert not (study / "claims" / "trial_0" / LOCK_FILE).exists()  # released: any worker may resume it

    result = run_worker(command)
    assert_ok(result)
    assert resumed(result.stdout) == [0] and started(result.stdout) == [], result.stdout
    assert "resumed from" in result.stdout and "(step 3, epoch 0)" in result.stdout
    summary = read_summary(study / "trial_0")
    assert summary["resumes"] == 1 and summary["steps"] == 16
    record = study_json(study)
    assert record["counts"] == {"complete": 3} and len(record["trials"]) == 3
    assert record["trials"][0]["value"] == summary["metrics"]["eval/top1"]


@pytest.mark.slow
def test_a_worker_sigkilled_mid_trial_and_started_again_resumes_that_trial_to_the_uninterrupted_digest(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A trial is a run of the recipe like any other; each recipe's own resume chain covers the
    recipe, this test the search's part (the claim left behind, the trial's parameters)."""
    recipe, overrides = "fashion_mnist", fashion_overrides(tmp_path_factory, *CHAIN_SETTINGS)
    study, marker = tmp_path / "study", tmp_path / "paused"
    command = search_command(recipe, write_space(tmp_path, FASHION_SPACE), study, 1, overrides)
    worker = start_worker(command, paused_env(3, marker))
    assert wait_for_pause(marker, worker) == 3  # mid-epoch: 8 steps per epoch
    kill_run(worker)  # the worker, its trial's run, everything: no clean-up anywhere
    assert latest_step(study / "trial_0" / "checkpoints") == 3
    assert claim_holder(study, 0)["pid"] == worker.pid  # the claim the killed worker left behind

    result = run_worker(command)
    assert_ok(result)
    assert f"took over the lock of {study / 'claims' / 'trial_0'}" in result.stdout
    assert f"its process {worker.pid} is gone" in result.stdout
    assert resumed(result.stdout) == [0] and started(result.stdout) == [], result.stdout
    summary = read_summary(study / "trial_0")
    assert summary["resumes"] == 1
    record = study_json(study)
    assert len(record["trials"]) == 1 and record["counts"] == {"complete": 1}  # resumed, not counted twice
    alone = trained_alone(recipe, overrides, record["trials"][0], tmp_path / "alone")
    assert summary["model_digest"] == alone["model_digest"] and summary["steps"] == alone["steps"]
    assert summary["metrics"] == alone["metrics"]


# ---- pruning and failures --------------------------------------------------------------------


def enqueued_study(folder: Path, space_text: str, overrides: list[str], trials: list[dict]) -> tuple[Path, Path]:
    """A study made as a worker makes it, with ``trials`` queued first (Optuna's enqueue_trial), so
    a test chooses the parameters of its first trials; the space file and the study folder."""
    from tools.search.space import check_against_recipe, load_space
    from tools.search.study import Settings, start_search

    space_path = write_space(folder, space_text)
    space = load_space(space_path)
    settings = Settings.from_space("fashion_mnist", overrides, space,
                                   check_against_recipe(space, "fashion_mnist", overrides))
    search = start_search(folder / "study", None, settings, print)
    for params in trials:
        search.study.enqueue_trial(params)
    return space_path, folder / "study"


@pytest.mark.slow
def test_a_trial_the_median_pruner_stops_checkpoints_and_is_recorded_pruned(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two ranks per trial (the ranks agree on rank 0's answer). Trial 0 learns; trial 1, at a
    learning rate 10,000 times smaller, has a worse eval/loss after its first epoch than trial 0
    had there, so the median pruner (after 1 trial) stops it."""
    overrides = fashion_overrides(tmp_path_factory, "trainer.batch_size=8", "trainer.epochs=3")
    space = ("objective: {metric: eval/loss, direction: min}\npruner: {name: median, n_startup_trials: 1}\n"
             "params:\n  optim.lr: {type: float, low: 1.0e-6, high: 1.0e-2, log: true}\n")
    space_path, study = enqueued_study(tmp_path, space, overrides, [{"optim.lr": 1e-2}, {"optim.lr": 1e-6}])
    result = run_worker(search_command("fashion_mnist", space_path, study, 2, overrides, "--nproc", "2"))
    assert_ok(result)
    steps_per_epoch = 256 // (8 * 2)
    assert f"pruned by the search at step {steps_per_epoch} (epoch 1)" in result.stdout
    assert f"trial 1: pruned after epoch 1 (step {steps_per_epoch})" in result.stdout
    summary = read_summary(study / "trial_1")
    assert summary["pruned"]["step"] == summary["steps"] == steps_per_epoch and summary["pruned"]["epoch"] == 1
    assert summary["pruned"]["metric"] == "eval/loss" and summary["world_size"] == 2
    assert latest_step(study / "trial_1" / "checkpoints") == steps_per_epoch  # it stopped cleanly, checkpointed
    record = study_json(study)
    trial_0, trial_1 = record["trials"]
    assert trial_0["state"] == "complete" and read_summary(study / "trial_0")["steps"] == 3 * steps_per_epoch
    assert list(trial_0["intermediate_values"]) == ["1", "2"]  # each epoch's end but the last
    assert trial_1["state"] == "pruned" and trial_1["pruned_at_epoch"] == 1
    assert trial_1["intermediate_values"] == {"1": summary["pruned"]["value"]}
    assert trial_1["intermediate_values"]["1"] > trial_0["intermediate_values"]["1"]
    assert record["best"]["trial"] == 0


def test_trials_whose_runs_fail_are_recorded_failed_with_the_reason_and_the_search_goes_on(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Trial 0's run stops on a user error (its data directory does not exist); trial 1's loss turns
    NaN at step 2 (tests/pause_hook), so its run stops with exit 3. Each trial is failed with its
    run's line, the worker goes on to the end, and no failed trial is the best."""
    good = str(fashion_data(tmp_path_factory))
    overrides = [override for override in fashion_overrides(tmp_path_factory) if not override.startswith("data.")]
    space = f"pruner: none\nparams:\n  data.root: {{type: choice, values: [{good}, /does/not/exist]}}\n"
    space_path, study = enqueued_study(tmp_path, space, overrides, [{"data.root": "/does/not/exist"},
                                                                     {"data.root": good}])
    env = recipe_env(PYTHONPATH=f"{REPO / 'tests' / 'pause_hook'}{os.pathsep}{REPO}", NONFINITE_AT_STEP="2")
    result = run_worker(search_command("fashion_mnist", space_path, study, 2, overrides), env)
    assert_ok(result)
    record = study_json(study)
    user_error, diverged = record["trials"]
    assert user_error["state"] == "fail"
    assert user_error["reason"].startswith("data directory /does/not/exist does not exist")
    assert user_error["value"] is None and not (study / "trial_0" / "summary.json").exists()
    assert re.search(r"^search: trial 0: failed: data directory /does/not/exist does not exist.*\(1 of 2 finished\)$",
                     result.stdout, re.MULTILINE), result.stdout
    assert diverged["state"] == "fail"
    assert diverged["reason"].startswith("the run diverged: the training was not finite at step 2"), diverged
    assert read_summary(Path(diverged["run_dir"]))["diverged"]["step"] == 2
    assert record["counts"] == {"fail": 2} and record["best"] is None


def test_a_trial_whose_run_directory_another_launch_holds_is_left_to_it_not_failed(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Trial 0's run directory is locked by a live process (here this test's, as the run of a
    worker that vanished while its run went on would): the trial's run exits 2 refused, and the
    worker leaves the trial running, neither failed nor started again."""
    from common.run_lock import RunLock

    overrides = fashion_overrides(tmp_path_factory)
    params = {"optim.lr": 0.002, "optim.name": "sgd"}
    space_path, study = enqueued_study(tmp_path, FASHION_SPACE, overrides, [params])
    (study / "trial_0").mkdir()
    (study / "trial_0" / "trial.json").write_text(json.dumps({"study": "study", "trial": 0, "params": params}))
    lock = RunLock(study / "trial_0", log=print)
    lock.acquire()
    try:
        result = run_worker(search_command("fashion_mnist", space_path, study, 1, overrides))
    finally:
        lock.release()
    assert_ok(result)
    assert "is in use by another launch of this run" in result.stderr
    assert "trial 0: its run directory is in use by another launch; leaving the trial to it" in result.stdout
    assert "nothing left for this worker: trial(s) 0 run elsewhere" in result.stdout
    assert [trial["state"] for trial in study_json(study)["trials"]] == ["running"]


def test_a_study_in_a_database_instead_of_the_journal(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
                                                      ) -> None:
    """``--storage sqlite:///...`` (STORAGE=): the study, and the trials' reports, go to the database."""
    overrides = fashion_overrides(tmp_path_factory, "trainer.epochs=3")
    database = f"sqlite:///{tmp_path / 'study.db'}"
    study = tmp_path / "study"
    result = run_worker(search_command("fashion_mnist", write_space(tmp_path, FASHION_SPACE), study, 1, overrides,
                                       "--storage", database))
    assert_ok(result)
    assert not (study / "journal.log").exists()
    import optuna

    (trial,) = optuna.load_study(study_name="study", storage=database).get_trials()
    assert trial.state.name == "COMPLETE" and sorted(trial.intermediate_values) == [1, 2]
    assert trial.value == read_summary(study / "trial_0")["metrics"]["eval/top1"] == study_json(study)["best"]["value"]


# ---- what a study folder can hold that is not the study's --------------------------------------


@pytest.mark.slow
def test_a_folder_in_the_way_of_a_trial_is_moved_aside_never_resumed_with_other_parameters(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A study whose journal was lost (deleted, or an older copy restored) asks for trial 0 again;
    the trial_0 folder of the lost trial, with its checkpoints, must not be resumed."""
    overrides = fashion_overrides(tmp_path_factory)
    space_path, study = enqueued_study(tmp_path, FASHION_SPACE, overrides, [{"optim.lr": 0.002, "optim.name": "sgd"}])
    assert_ok(run_worker(search_command("fashion_mnist", space_path, study, 1, overrides)))
    (study / "journal.log").unlink()
    enqueued_study(tmp_path, FASHION_SPACE, overrides, [{"optim.lr": 0.005, "optim.name": "sgd"}])
    result = run_worker(search_command("fashion_mnist", space_path, study, 1, overrides))
    assert_ok(result)
    assert f"trial 0: {study / 'trial_0'} held another run" in result.stdout
    assert f"moved it to {study / 'trial_0.replaced-1'}" in result.stdout
    assert "resumed from" not in result.stdout
    assert json.loads((study / "trial_0.replaced-1" / "trial.json").read_text())["params"]["optim.lr"] == 0.002
    assert read_summary(study / "trial_0")["resumes"] == 0
    assert "lr: 0.005" in (study / "trial_0" / ".hydra" / "config.yaml").read_text()


def test_a_journal_cut_in_the_middle_of_an_entry_is_repaired_before_anything_appends_to_it(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture) -> None:
    """Optuna skips an incomplete last line, but the next entry appended to it makes a line it
    cannot read, and then no worker can read the study. A worker cuts it first."""
    import optuna

    from common.run.search_trial import open_storage

    overrides = fashion_overrides(tmp_path_factory)
    _, study = enqueued_study(tmp_path, FASHION_SPACE, overrides, [{"optim.lr": 0.002, "optim.name": "sgd"}])
    journal = study / "journal.log"
    whole = journal.read_bytes()
    journal.write_bytes(whole + b'{"op_code": 5, "worker_id": "x", "tri')  # a copy taken mid-write
    capsys.readouterr()
    enqueued_study(tmp_path, FASHION_SPACE, overrides, [{"optim.lr": 0.005, "optim.name": "sgd"}])
    assert f"cut an incomplete last entry (37 bytes) from {journal}" in capsys.readouterr().out
    assert journal.read_bytes().startswith(whole)
    trials = optuna.load_study(study_name="study", storage=open_storage(str(journal))).get_trials()
    assert [trial.system_attrs["fixed_params"]["optim.lr"] for trial in trials] == [0.002, 0.005]


# ---- the ISC: one worker per experiment, across cycles --------------------------------------


SEARCH_ISC = REPO / "cluster" / "isc" / "search" / "fashion_mnist.isc"


def isc_command(isc: dict[str, str], space: Path, overrides: list[str]) -> list[str]:
    """The search command of ``SEARCH_ISC`` with the ISC's variables set to ``isc``, 2 trials of
    ``space``, and ``overrides`` after its own (its /data/<dataset-id> left to them)."""
    import shlex
    import string
    import tomllib

    command = " ".join(tomllib.loads(SEARCH_ISC.read_text())["command"].split())
    words = shlex.split(command.split("&&")[-1])
    assert words[:4] == ["python", "-m", "tools.search", "fashion_mnist"], words
    options, own = words[4:words.index("--")], words[words.index("--") + 1:]
    options[options.index("--trials") + 1] = "2"
    for variable in isc:
        assert f"${variable}" in command, variable
    expanded = [string.Template(word).substitute(isc) for word in options]
    return [sys.executable, "-m", "tools.search", "fashion_mnist", *expanded, "--space", str(space), "--",
            *(word for word in own if not word.startswith("data.root=")), *overrides]


@pytest.mark.slow
def test_a_search_on_the_isc_goes_on_across_cycles_from_what_the_isc_ships(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The command of cluster/isc/search/fashion_mnist.isc, locally. Cycle 1 ends with a SIGKILL of
    everything in the middle of trial 0; the ISC's sync ships what it ships (the model of
    tools/isc_rehearse.py: each saver's latest checkpoint and the _force directories); cycle 2
    starts at other paths, from the restored checkpoint artifact and an empty Lossy folder, and
    the search finishes: trial 0 resumed from the shipped checkpoint to the uninterrupted run's
    digest, then trial 1, nothing counted twice."""
    import shutil
    import tomllib

    from tools.isc_rehearse import restore, sync_checkpoints

    fields = tomllib.loads(SEARCH_ISC.read_text())
    assert {"isc_project_id", "experiment_name", "gpus", "compute_mode", "dataset_id_list", "command"} == set(fields)
    assert f'compute_mode = "{fields["compute_mode"]}"' in SEARCH_ISC.read_text()
    assert f"data.root=/data/{fields['dataset_id_list'][0]}" in fields["command"]

    store, marker = tmp_path / "store", tmp_path / "paused"
    overrides = fashion_overrides(tmp_path_factory, *CHAIN_SETTINGS)
    space = write_space(tmp_path, FASHION_SPACE)

    def node(cycle: int) -> tuple[Path, Path, list[str], dict[str, str]]:
        folder = tmp_path / f"cycle-{cycle}"
        restore(store / "checkpoints", folder / "checkpoints")
        (folder / "lossy").mkdir(parents=True)
        isc = {"CHECKPOINT_ARTIFACT_PATH": str(folder / "checkpoints"), "LOSSY_ARTIFACT_PATH": str(folder / "lossy"),
               "N_PROC": "1"}
        return folder / "checkpoints", folder / "lossy" / "search", isc_command(isc, space, overrides), isc

    artifacts, study, command, isc = node(1)
    worker = start_worker(command, paused_env(3, marker, **isc))
    assert wait_for_pause(marker, worker) == 3
    kill_run(worker)
    sync_checkpoints(artifacts, store / "checkpoints")
    shutil.copytree(study.parent, store / "lossy", symlinks=True)
    shutil.rmtree(tmp_path / "cycle-1")

    artifacts, study, command, isc = node(2)
    result = run_worker(command, recipe_env(**isc))
    assert_ok(result)
    assert "restored the study's journal from" in result.stdout
    assert resumed(result.stdout) == [0] and started(result.stdout) == [1], result.stdout
    assert "resumed from" in result.stdout and "(step 3, epoch 0)" in result.stdout
    record = study_json(study)
    assert record["counts"] == {"complete": 2} and len(record["trials"]) == 2
    summary = read_summary(study / "trial_0")
    assert summary["resumes"] == 1
    alone = trained_alone("fashion_mnist", overrides, record["trials"][0], tmp_path / "alone")
    assert summary["model_digest"] == alone["model_digest"]
    for number in (0, 1):  # each trial's checkpoints moved into its run directory when it ended
        assert latest_step(study / f"trial_{number}" / "checkpoints") == 16
    assert sorted(path.name for path in artifacts.iterdir() if "AtomicDirectory" in path.name) == []
