"""Rehearse an ISC experiment on this machine, with the ISC's artifact sync, before spending cycles on it.

    python -m tools.isc_rehearse cluster/isc/<recipe>.isc [--cycles 5] [--cycle-seconds 90[,90,...]]
        [--sync-seconds 600] [--data DIR] [--nproc N] [--work-dir DIR] [-- extra hydra overrides]
    make isc-rehearse RECIPE=<recipe> [CYCLES=5] [CYCLE_S=90] [ARGS="--data DIR -- overrides"]

It runs the experiment's own ``command`` the way the ISC would: the ISC's variables get local
values (NNODES=1, N_PROC, MASTER_ADDR=127.0.0.1, a free MASTER_PORT, NODE_RANK=0), HOME is a
folder where ``~/training-recipes`` is this repository, and ``/data/<dataset-id>`` becomes the
local data folder. Each cycle runs for its ``--cycle-seconds`` and is then killed with SIGKILL
(no warning, the worst case); after the cycles the run is left to finish.

What survives a cycle is modelled on Strong Compute's Checkpoint Artifacts. The work folder holds
an artifact store (``artifacts/``) beside each cycle's node-local folders (``cycle-<n>/``). At a
sync (every ``--sync-seconds`` of a cycle, and at its end) only what the ISC ships is copied to
the store: the directory that ``<name>.latest_checkpoint`` points at, the ``_force`` directories
and the symlink itself; the other checkpoint directories older than the shipped one are deleted
from the node, as the ISC deletes them. ``LOSSY_ARTIFACT_PATH`` is copied to the store as it is.
The next cycle starts with ``CHECKPOINT_ARTIFACT_PATH`` restored from the store at another path
(so the symlink's absolute target no longer exists), an empty ``LOSSY_ARTIFACT_PATH``, and the
previous cycle's folders gone.

Per cycle it prints the step it resumed from, the checkpoint shipped at its end with its step,
and the work lost (the age of that checkpoint at the kill). It fails when a cycle resumes from
anything but what was shipped, when a cycle ships nothing newer (no progress), when the work lost
exceeds one checkpoint interval (``checkpoint.every_seconds`` plus a few seconds for the step and
the write), or when the finished run's ``summary.json`` is not in the store.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from common.errors import EXIT_USER_ERROR, UserError
from tools.processes import kill_tree

REPO = Path(__file__).resolve().parents[1]
REQUIRED_KEYS = {"isc_project_id": str, "experiment_name": str, "gpus": int, "command": str}
# What each documented compute_mode means on the ISC; an absent compute_mode is "cycle", the documented default.
COMPUTE_MODES = {
    "cycle": "rapid cycling: about 90 s at a time, interrupted and resumed",
    "interruptible": "runs when capacity is free, interrupted and resumed when it is needed",
    "burst": "a dedicated cluster, uninterrupted unless stopped",
}
ISC_VARIABLES = ("$NNODES", "$N_PROC", "$MASTER_ADDR", "$MASTER_PORT", "$NODE_RANK")
RECIPE_MODULE = re.compile(r"-m\s+recipes\.(\w+)\.train\b")
DATA_PATH = re.compile(r"/data/([\w.-]+)")
RESUMED = re.compile(r"resumed from \S+ \(step (\d+)")
# The ISC's rules for Checkpoint Artifacts (cycling_utils' AtomicDirectory and Strong Compute's docs).
CHECKPOINT_DIR = re.compile(r"_checkpoint_(\d+)(_force)?$")
SYMLINK_SUFFIX = ".latest_checkpoint"
# Time a kill may land after the checkpoint interval elapsed: the step in flight and the write.
GRACE_S = 5.0


@dataclass(frozen=True)
class IscExperiment:
    path: Path
    fields: dict
    recipe: str

    @property
    def compute_mode(self) -> str:
        return self.fields.get("compute_mode", "cycle")

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
    if fields.get("compute_mode", "cycle") not in COMPUTE_MODES:
        raise UserError(f"{path}: compute_mode must be one of {', '.join(COMPUTE_MODES)}, not "
                        f"{fields['compute_mode']!r}")
    datasets = fields.get("dataset_id_list", [])
    if not isinstance(datasets, list):
        raise UserError(f"{path}: dataset_id_list must be a list of dataset IDs")
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
        if dataset not in datasets:
            raise UserError(f"{path}: the command reads /data/{dataset}, which is not in dataset_id_list")
    return IscExperiment(path=path, fields=fields, recipe=recipe)


# ---- the artifact sync -------------------------------------------------------------------------


@dataclass(frozen=True)
class Shipped:
    """The checkpoint a symlink named at a sync, now in the store."""

    name: str
    step: int
    completed_at: float  # wall-clock time its manifest (written last) was complete


def _checkpoint_index(path: Path) -> int | None:
    match = CHECKPOINT_DIR.search(path.name)
    return int(match.group(1)) if match and path.is_dir() and not path.is_symlink() else None


def _copy_into(source: Path, destination: Path) -> None:
    """Copy a directory into the store, atomically, so a store never holds half a checkpoint."""
    partial = destination.with_name(f".partial-{destination.name}")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial, symlinks=True)
    os.replace(partial, destination)


def sync_checkpoints(live: Path, store: Path) -> Shipped | None:
    """One sync of Checkpoint Artifacts from ``live`` (CHECKPOINT_ARTIFACT_PATH) into ``store``.

    Ships what each ``*.latest_checkpoint`` symlink points at, every ``_force`` directory, and the
    symlinks; deletes from ``live`` the other checkpoint directories of the same saver name older
    than the shipped one (newer ones were written after the symlink was read and wait for the next
    sync; several savers each have their own name). Returns the shipped latest checkpoint (the last
    symlink's, by name) or None if there is none.
    """
    store.mkdir(parents=True, exist_ok=True)
    shipped = None
    for link in sorted(live.glob(f"*{SYMLINK_SUFFIX}")):
        if not link.is_symlink():
            continue
        target_path = os.readlink(link)
        target = live / Path(target_path).name  # the symlink is absolute; this node's copy has the same name
        index = _checkpoint_index(target)
        if index is None:
            continue
        if not (store / target.name).exists():
            _copy_into(target, store / target.name)
        manifest = store / target.name / "manifest.json"
        shipped = Shipped(target.name, json.loads(manifest.read_text())["step"], manifest.stat().st_mtime)
        temp = store / f".partial-{link.name}"
        temp.unlink(missing_ok=True)
        os.symlink(target_path, temp)
        os.replace(temp, store / link.name)
        saver = link.name.removesuffix(SYMLINK_SUFFIX)
        for path in live.iterdir():
            other = _checkpoint_index(path)
            if other is None or path == target:
                continue
            if path.name.endswith("_force"):
                if not (store / path.name).exists():
                    _copy_into(path, store / path.name)
            elif other < index and path.name.startswith(f"{saver}_checkpoint_"):
                shutil.rmtree(path, ignore_errors=True)
    return shipped


def restore(store: Path, live: Path) -> None:
    """A cycle's CHECKPOINT_ARTIFACT_PATH: a fresh copy of the store (symlinks copied as they are)."""
    if store.is_dir():
        shutil.copytree(store, live, symlinks=True)
    else:
        live.mkdir(parents=True)


# ---- running cycles ----------------------------------------------------------------------------


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
    shipped: Shipped | None  # what the store's symlink names after the cycle's last sync
    ended_at: float  # wall-clock time of the kill or the exit
    log: Path

    @property
    def work_lost_s(self) -> float | None:
        if not self.killed:
            return None
        return self.ended_at - self.shipped.completed_at if self.shipped is not None else self.seconds


def _run_cycle(command: str, env: dict[str, str], cwd: Path, limit_s: float | None, sync_s: float, number: int,
               log: Path, store: Path, previous: Shipped | None) -> Cycle:
    """Run the command once, syncing every ``sync_s`` seconds; after ``limit_s`` seconds SIGKILL it
    and all its descendants; then the end-of-cycle sync."""
    live, lossy = Path(env["CHECKPOINT_ARTIFACT_PATH"]), Path(env["LOSSY_ARTIFACT_PATH"])
    start = time.monotonic()
    resumed: list[int] = []
    stop_syncing = threading.Event()
    shipped = [previous]

    def sync_periodically() -> None:
        while not stop_syncing.wait(sync_s):
            shipped[0] = sync_checkpoints(live, store / "checkpoints") or shipped[0]

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
        syncer = threading.Thread(target=sync_periodically, daemon=True)
        reader.start()
        syncer.start()
        try:
            process.wait(timeout=limit_s)
            killed = False
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)
            process.wait()
            killed = True
        ended_at = time.time()
        stop_syncing.set()
        syncer.join()
        reader.join(timeout=30)
    shipped[0] = sync_checkpoints(live, store / "checkpoints") or shipped[0]
    if lossy.is_dir():
        shutil.copytree(lossy, store / "lossy", symlinks=True, dirs_exist_ok=True)
    return Cycle(number, time.monotonic() - start, killed, None if killed else process.returncode,
                 resumed[0] if resumed else None, shipped[0], ended_at, log)


def _check_cycle(cycle: Cycle, previous: Shipped | None, interval_s: float) -> None:
    """Raise UserError when the cycle resumed from anything but what was shipped, lost work or made none."""
    expected = previous.step if previous else None
    if (cycle.resumed_from is not None or not cycle.killed) and cycle.resumed_from != expected:
        shipped = f"step {expected} ({previous.name})" if previous else "nothing"
        raise UserError(f"cycle {cycle.number} resumed from step {cycle.resumed_from}, but the ISC had shipped "
                        f"{shipped} (log: {cycle.log})")
    if not cycle.killed:
        if cycle.exit_code != 0:
            raise UserError(f"cycle {cycle.number}: the command exited with code {cycle.exit_code} (log: {cycle.log})")
        return
    if cycle.shipped is None or (previous is not None and cycle.shipped.step <= previous.step):
        reached = "nothing" if cycle.shipped is None else f"step {cycle.shipped.step}"
        raise UserError(f"cycle {cycle.number} made no progress in {cycle.seconds:.0f} s (the ISC shipped {reached}); "
                        f"make cycles longer than start-up plus one checkpoint interval (log: {cycle.log})")
    if interval_s > 0 and cycle.work_lost_s > interval_s + GRACE_S:
        raise UserError(f"cycle {cycle.number}: the shipped checkpoint was {cycle.work_lost_s:.1f} s old at the kill, "
                        f"more than one checkpoint interval ({interval_s:g} s + {GRACE_S:g} s): that work is lost")


def _resolved_config(recipe: str, overrides: list[str], env: dict[str, str]) -> DictConfig:
    """The recipe's config with these overrides, resolved with ``env`` (the ISC's paths) set."""
    from common.entry import compose_config

    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        cfg = compose_config(recipe, overrides)
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
    shipped = "-" if cycle.shipped is None else cycle.shipped.name
    step = "-" if cycle.shipped is None else f"step {cycle.shipped.step}"
    lost = "-" if cycle.work_lost_s is None else f"{cycle.work_lost_s:.1f} s"
    print(f"{cycle.number:>5}  {outcome:<22}  {resumed:>12}  {shipped:<40}  {step:>10}  {lost:>9}", flush=True)


def _cycle_lengths(spec: str, cycles: int) -> list[float]:
    """``90`` or ``2,30,30``: one length per cycle, the last one repeated."""
    try:
        lengths = [float(part) for part in spec.split(",")]
    except ValueError:
        raise UserError(f"--cycle-seconds {spec!r} is not a number or a comma-separated list of numbers") from None
    if cycles < 1 or any(length <= 0 for length in lengths):
        raise UserError("--cycles must be at least 1 and every --cycle-seconds positive")
    return [lengths[min(i, len(lengths) - 1)] for i in range(cycles)]


def rehearse(isc_file: Path, cycles: int, cycle_seconds: str, sync_s: float, data: Path | None, nproc: int,
             work_dir: Path | None, overrides: list[str], finish_timeout_s: float) -> dict:
    experiment = load_experiment(isc_file)
    lengths = _cycle_lengths(cycle_seconds, cycles)
    if sync_s <= 0:
        raise UserError("--sync-seconds must be positive")
    default_work = REPO / "runs" / "isc_rehearsal" / f"{experiment.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    work = (work_dir or default_work).resolve()
    if work.exists() and any(work.iterdir()):
        raise UserError(f"work directory {work} is not empty; give a new --work-dir")
    home, store = work / "home", work / "artifacts"
    _fake_home(home)
    if data is None:
        data = REPO / _resolved_config(experiment.recipe, [], {}).data.root
    if not data.exists():
        raise UserError(f"local data folder {data} does not exist (give --data DIR)")
    local_data = shlex.quote(str(data.resolve()))
    command = DATA_PATH.sub(lambda _: local_data, experiment.command_line)
    command = " ".join([command, *map(shlex.quote, overrides)])
    print(f"rehearsing {isc_file} ({experiment.recipe}), compute_mode {experiment.compute_mode!r} "
          f"({COMPUTE_MODES[experiment.compute_mode]}): {cycles} cycle(s) of {cycle_seconds} s killed with SIGKILL, "
          f"then to the end; an artifact sync every {sync_s:g} s and at each cycle's end; work dir {work}", flush=True)
    print(f"{'cycle':>5}  {'outcome':<22}  {'resumed from':>12}  {'shipped at its end':<40}  {'step':>10}  "
          f"{'work lost':>9}", flush=True)
    previous: Shipped | None = None
    for number in range(1, cycles + 2):
        last = number == cycles + 1
        node = work / f"cycle-{number}"
        restore(store / "checkpoints", node / "checkpoints")
        (node / "lossy").mkdir(parents=True)
        env = {
            **os.environ,
            "HOME": str(home),
            "NNODES": "1",
            "N_PROC": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "NODE_RANK": "0",
            "CHECKPOINT_ARTIFACT_PATH": str(node / "checkpoints"),
            "OUTPUT_PATH": str(node / "checkpoints"),
            "LOSSY_ARTIFACT_PATH": str(node / "lossy"),
        }
        cfg = _resolved_config(experiment.recipe, _command_overrides(experiment.recipe, command, env), env)
        cycle = _run_cycle(command, env, home, finish_timeout_s if last else lengths[number - 1], sync_s, number,
                           work / f"cycle-{number}.log", store, previous)
        shutil.rmtree(node)  # the node's disk is gone; only the store remains
        _print_cycle(cycle)
        if last and cycle.killed:
            raise UserError(f"the run did not finish within {finish_timeout_s:g} s after the cycles (log: {cycle.log})")
        _check_cycle(cycle, previous, float(cfg.checkpoint.every_seconds))
        previous = cycle.shipped
        if not cycle.killed:
            break
    return _finished_summary(Path(cfg.run_dir), Path(env["LOSSY_ARTIFACT_PATH"]), store, number)


def _finished_summary(run_dir: Path, lossy: Path, store: Path, cycles: int) -> dict:
    """The finished run's summary.json, from the store: the only place it survives on the ISC."""
    if not run_dir.is_relative_to(lossy):
        raise UserError(f"the run writes summary.json into {run_dir}, which the ISC does not keep: pass "
                        f"run_dir=$LOSSY_ARTIFACT_PATH in the command")
    summary_path = store / "lossy" / run_dir.relative_to(lossy) / "summary.json"
    if not summary_path.is_file():
        raise UserError(f"the run finished but its summary.json is not in the artifact store ({summary_path})")
    summary = json.loads(summary_path.read_text())
    print(f"finished after {cycles} cycle(s): {summary['steps']} steps, {summary['resumes']} resume(s), "
          f"model_digest {summary['model_digest'][:16]}...; summary {summary_path}", flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.isc_rehearse", description=__doc__.splitlines()[0],
                                     epilog="Extra hydra overrides for the command go after --.")
    parser.add_argument("isc_file", type=Path)
    parser.add_argument("--cycles", type=int, default=5, help="cycles killed with SIGKILL before the final one")
    parser.add_argument("--cycle-seconds", default="90", help="length of each cycle (the ISC's is 90 s), or a "
                        "comma-separated list of lengths (the last one repeats)")
    parser.add_argument("--sync-seconds", type=float, default=600, help="seconds between the ISC's artifact syncs")
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
        rehearse(args.isc_file, args.cycles, args.cycle_seconds, args.sync_seconds, args.data, nproc, args.work_dir,
                 overrides, args.finish_timeout)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
