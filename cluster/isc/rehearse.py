"""Rehearse the ISC's rapid cycling on this machine, before spending cycles on it.

    python -m cluster.isc.rehearse cluster/isc/<recipe>.isc [--cycles 5] [--cycle-seconds 90]
        [--data DIR] [--nproc N] [--work-dir DIR] [-- extra hydra overrides]
    make isc-rehearse RECIPE=<recipe> [CYCLES=5] [CYCLE_S=90] [ARGS="--data DIR -- overrides"]

It runs the experiment's own ``command`` the way the ISC would, with the ISC's variables set
to local values (NNODES=1, N_PROC, MASTER_ADDR=127.0.0.1, a free MASTER_PORT, NODE_RANK=0,
CHECKPOINT_ARTIFACT_PATH and LOSSY_ARTIFACT_PATH under the work directory), HOME pointing at
a directory where ``~/training-recipes`` is this repository, and ``/data/<dataset-id>``
replaced by the local data folder. Each cycle runs ``--cycle-seconds`` and is then killed
with SIGKILL (no warning, the worst case); the next cycle starts the command again. After the
cycles the run is left to finish.

It fails when a cycle makes no progress (no newer checkpoint), when a restart resumes from
anything but the newest checkpoint on disk at the kill, when that checkpoint was more than one
checkpoint interval (``checkpoint.every_seconds`` plus a few seconds for the step and the
write) old at the kill, or when the finished run has no ``summary.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from cluster.processes import kill_tree
from common.errors import EXIT_USER_ERROR, UserError

REPO = Path(__file__).resolve().parents[2]
REQUIRED_KEYS = {"isc_project_id": str, "experiment_name": str, "gpus": int, "compute_mode": str,
                 "dataset_id_list": list, "command": str}
ISC_VARIABLES = ("$NNODES", "$N_PROC", "$MASTER_ADDR", "$MASTER_PORT", "$NODE_RANK")
RECIPE_MODULE = re.compile(r"-m\s+recipes\.(\w+)\.train\b")
DATA_PATH = re.compile(r"/data/([\w.-]+)")
RESUMED = re.compile(r"resumed from \S+ \(step (\d+)")
# Time a kill may land after the checkpoint interval elapsed: the step in flight and the write.
GRACE_S = 5.0


@dataclass(frozen=True)
class IscExperiment:
    path: Path
    fields: dict
    recipe: str

    @property
    def command_line(self) -> str:
        """The command as one line: the ISC joins the lines of a multi-line command with spaces."""
        return " ".join(line.strip() for line in self.fields["command"].splitlines() if line.strip())


def load_experiment(path: Path) -> IscExperiment:
    """Parse and check an .isc file; every problem is a one-line :class:`UserError`."""
    if not path.is_file():
        raise UserError(f"{path} does not exist")
    try:
        fields = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise UserError(f"{path} is not valid TOML: {error}") from error
    for key, kind in REQUIRED_KEYS.items():
        if not isinstance(fields.get(key), kind):
            raise UserError(f"{path}: {key} is missing or not a {kind.__name__}")
    if fields["compute_mode"] not in ("cycle", "burst"):
        raise UserError(f"{path}: compute_mode must be 'cycle' or 'burst', not {fields['compute_mode']!r}")
    command = fields["command"]
    missing = [name for name in ISC_VARIABLES if name not in command]
    if missing:
        raise UserError(f"{path}: the command does not use {', '.join(missing)}")
    match = RECIPE_MODULE.search(command)
    if match is None:
        raise UserError(f"{path}: the command runs no `-m recipes.<recipe>.train`")
    recipe = match.group(1)
    if not (REPO / "recipes" / recipe / "train.py").is_file():
        raise UserError(f"{path}: the command names recipe {recipe!r}, which has no recipes/{recipe}/train.py")
    for dataset in DATA_PATH.findall(command):
        if dataset not in fields["dataset_id_list"]:
            raise UserError(f"{path}: the command reads /data/{dataset}, which is not in dataset_id_list")
    return IscExperiment(path=path, fields=fields, recipe=recipe)


@dataclass(frozen=True)
class Checkpoint:
    step: int
    completed_at: float  # wall-clock time its manifest (written last) was complete


def newest_checkpoint(directory: Path) -> Checkpoint | None:
    complete = [(int(path.name.removeprefix("step_")), path / "manifest.json")
                for path in directory.glob("step_*") if (path / "manifest.json").is_file()]
    if not complete:
        return None
    step, manifest = max(complete)
    return Checkpoint(step, manifest.stat().st_mtime)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fake_home(home: Path) -> None:
    """A HOME where ~/training-recipes is this repository, as on an ISC container."""
    home.mkdir(parents=True, exist_ok=True)
    link = home / "training-recipes"
    if not link.exists():
        link.symlink_to(REPO, target_is_directory=True)
    if not (REPO / ".venv" / "bin" / "activate").is_file():
        raise UserError("the .isc command activates ~/training-recipes/.venv: run `make setup` first")


@dataclass
class Cycle:
    number: int
    seconds: float
    killed: bool
    exit_code: int | None
    resumed_from: int | None
    newest: Checkpoint | None
    ended_at: float  # wall-clock time of the kill or the exit
    log: Path

    @property
    def checkpoint_age_s(self) -> float | None:
        return None if self.newest is None else self.ended_at - self.newest.completed_at


def _run_cycle(command: str, env: dict[str, str], cwd: Path, limit_s: float | None, number: int,
               log: Path) -> Cycle:
    """Run the command once; after ``limit_s`` seconds SIGKILL it and all its descendants."""
    start = time.monotonic()
    resumed: list[int] = []
    with open(log, "w") as out:
        process = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)

        def copy_output() -> None:
            for line in process.stdout:
                out.write(line)
                out.flush()
                if match := RESUMED.search(line):
                    resumed.append(int(match.group(1)))

        reader = threading.Thread(target=copy_output, daemon=True)
        reader.start()
        try:
            process.wait(timeout=limit_s)
            killed = False
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)
            process.wait()
            killed = True
        ended_at = time.time()
        reader.join(timeout=30)
    newest = newest_checkpoint(Path(env["CHECKPOINT_ARTIFACT_PATH"]))
    return Cycle(number, time.monotonic() - start, killed, None if killed else process.returncode,
                 resumed[0] if resumed else None, newest, ended_at, log)


def _check_cycle(cycle: Cycle, previous: Checkpoint | None, interval_s: float) -> None:
    """Raise UserError when the cycle lost work or made none."""
    expected = previous.step if previous else None
    if (cycle.resumed_from is not None or not cycle.killed) and cycle.resumed_from != expected:
        raise UserError(f"cycle {cycle.number} resumed from step {cycle.resumed_from}, but the newest complete "
                        f"checkpoint on disk was step {expected} (log: {cycle.log})")
    if not cycle.killed:
        if cycle.exit_code != 0:
            raise UserError(f"cycle {cycle.number}: the command exited with code {cycle.exit_code} (log: {cycle.log})")
        return
    if cycle.newest is None or (previous is not None and cycle.newest.step <= previous.step):
        raise UserError(f"cycle {cycle.number} made no progress in {cycle.seconds:.0f} s (newest checkpoint still "
                        f"{'none' if cycle.newest is None else f'step {cycle.newest.step}'}); make the cycle longer "
                        f"than start-up plus one checkpoint interval (log: {cycle.log})")
    age = cycle.checkpoint_age_s
    if interval_s > 0 and age > interval_s + GRACE_S:
        raise UserError(f"cycle {cycle.number}: at the kill the newest checkpoint was {age:.1f} s old, more than one "
                        f"checkpoint interval ({interval_s:g} s + {GRACE_S:g} s); a restart loses that work")


def _resolved_config(recipe: str, overrides: list[str], env: dict[str, str]) -> DictConfig:
    """The recipe's config with these overrides, resolved with ``env`` (the ISC's paths) set."""
    from common.entry import validate_overrides

    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        importlib.import_module(f"recipes.{recipe}.config")  # registers the schema
        cfg = validate_overrides(recipe, overrides)
        OmegaConf.resolve(cfg)
        return cfg
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _command_overrides(recipe: str, command: str, env: dict[str, str]) -> list[str]:
    """The hydra overrides the command passes to the recipe, with the variables expanded."""
    after_module = command.split(f"recipes.{recipe}.train", 1)[1]
    expanded = re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), m.group(0)), after_module)
    return [token for token in shlex.split(expanded) if "=" in token and not token.startswith("-")]


def _print_cycle(cycle: Cycle) -> None:
    ending = "killed" if cycle.killed else f"exited {cycle.exit_code}"
    outcome = f"{ending} after {cycle.seconds:.0f} s"
    resumed = "-" if cycle.resumed_from is None else f"step {cycle.resumed_from}"
    reached = "-" if cycle.newest is None else f"step {cycle.newest.step}"
    age = "-" if cycle.newest is None or not cycle.killed else f"{cycle.checkpoint_age_s:.1f} s"
    print(f"{cycle.number:>5}  {outcome:<24}  {resumed:>12}  {reached:>17}  {age:>15}", flush=True)


def rehearse(isc_file: Path, cycles: int, cycle_s: float, data: Path | None, nproc: int, work_dir: Path | None,
             overrides: list[str], finish_timeout_s: float) -> dict:
    experiment = load_experiment(isc_file)
    if cycles < 1 or cycle_s <= 0:
        raise UserError("--cycles must be at least 1 and --cycle-seconds positive")
    default_work = REPO / "runs" / "isc_rehearsal" / f"{experiment.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    work = (work_dir or default_work).resolve()
    if work.exists() and any(work.iterdir()):
        raise UserError(f"work directory {work} is not empty; give a new --work-dir")
    home = work / "home"
    _fake_home(home)
    if data is None:
        data = REPO / _resolved_config(experiment.recipe, [], {}).data.root
    if not data.exists():
        raise UserError(f"local data folder {data} does not exist (give --data DIR)")
    local_data = shlex.quote(str(data.resolve()))
    command = DATA_PATH.sub(lambda _: local_data, experiment.command_line)
    command = " ".join([command, *map(shlex.quote, overrides)])
    env = {
        **os.environ,
        "HOME": str(home),
        "NNODES": "1",
        "N_PROC": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "NODE_RANK": "0",
        "CHECKPOINT_ARTIFACT_PATH": str(work / "checkpoints"),
        "LOSSY_ARTIFACT_PATH": str(work / "lossy"),
    }
    cfg = _resolved_config(experiment.recipe, _command_overrides(experiment.recipe, command, env), env)
    interval_s, run_dir = float(cfg.checkpoint.every_seconds), Path(cfg.run_dir)
    print(f"rehearsing {isc_file} ({experiment.recipe}): {cycles} cycle(s) of {cycle_s:g} s killed with SIGKILL, "
          f"then to the end; checkpoint interval {interval_s:g} s; work dir {work}", flush=True)
    print("cycle  outcome                   resumed from  newest checkpoint  its age at kill", flush=True)
    previous: Checkpoint | None = None
    finished = False
    for number in range(1, cycles + 2):
        last = number == cycles + 1
        cycle = _run_cycle(command, env, home, finish_timeout_s if last else cycle_s, number,
                           work / f"cycle-{number}.log")
        _print_cycle(cycle)
        if last and cycle.killed:
            raise UserError(f"the run did not finish within {finish_timeout_s:g} s after the cycles (log: {cycle.log})")
        _check_cycle(cycle, previous, interval_s)
        previous = cycle.newest
        if not cycle.killed:
            finished = True
            break
    summary_path = run_dir / "summary.json"
    if not finished or not summary_path.is_file():
        raise UserError(f"the run finished but wrote no {summary_path}")
    summary = json.loads(summary_path.read_text())
    print(f"finished after {number} cycle(s): {summary['steps']} steps, {summary['resumes']} resume(s), "
          f"model_digest {summary['model_digest'][:16]}...; summary {summary_path}", flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.isc.rehearse", description=__doc__.splitlines()[0],
                                     epilog="Extra hydra overrides for the command go after --.")
    parser.add_argument("isc_file", type=Path)
    parser.add_argument("--cycles", type=int, default=5, help="cycles killed with SIGKILL before the final one")
    parser.add_argument("--cycle-seconds", type=float, default=90, help="length of a cycle (the ISC's is 90 s)")
    parser.add_argument("--data", type=Path, default=None, help="local folder for /data/<dataset-id> "
                        "(default: the recipe's data.root)")
    parser.add_argument("--nproc", type=int, default=None, help="N_PROC (default: the GPU count, else 1)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="default: runs/isc_rehearsal/<recipe>-<date>-<time>")
    parser.add_argument("--finish-timeout", type=float, default=3600, help="seconds the final cycle may take")
    argv = sys.argv[1:] if argv is None else argv
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    nproc = args.nproc
    if nproc is None:
        import torch

        nproc = max(1, torch.cuda.device_count())
    try:
        rehearse(args.isc_file, args.cycles, args.cycle_seconds, args.data, nproc, args.work_dir, overrides,
                 args.finish_timeout)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
