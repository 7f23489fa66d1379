"""Start a real local SLURM cluster for tests (one node, or several in namespaces), and talk to it.

This is a helper module, not a test module. The session fixtures ``slurm_env``
(one node) and ``multinode_slurm`` (two nodes) in ``tests/conftest.py`` start
the clusters with ``running_local_slurm``; tests take a fixture and call
``sc.sbatch(...)`` and ``sc.wait_for_job(...)``.

The cluster comes from ``tools/slurm_local_cluster.sh`` (Debian's
``slurm-wlm`` and ``munge``, run as root). It has no accounting storage, so job
states are read with ``scontrol show job`` (the script sets MinJobAge=3600, so
finished jobs stay visible); ``sacct`` is used only if it works.

Policy: without SLURM the tests are skipped, unless ``REQUIRE_SLURM=1`` (set in
CI), where a missing SLURM is a failure. The same holds for the several-node
cluster, which also needs network and UTS namespaces: skipped where they are not
permitted, a failure with ``REQUIRE_MULTINODE=1`` (set in CI).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "tools" / "slurm_local_cluster.sh"

# Job states after which a job never runs again by itself.
FINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "REVOKED",
        "SPECIAL_EXIT",
    }
)

# Where Debian puts the daemons; a non-root PATH often lacks the sbin dirs.
_SEARCH_PATH = os.pathsep.join(
    [os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"]
)

# Environment of the cluster started last (used when a helper gets no env).
_active_env: dict[str, str] = {}


class SlurmError(RuntimeError):
    """A SLURM command or the local cluster script failed."""


@dataclass(frozen=True)
class LocalCluster:
    """A running local cluster: its client environment, state directory and node names."""

    env: dict[str, str]
    state_dir: Path
    nodes: tuple[str, ...]

    def scratch(self, node: str) -> Path:
        """``node``'s own scratch folder (its TMPDIR, seen at one path on every node), from this host."""
        return self.state_dir / "nodes" / node / "scratch"


def slurm_available() -> tuple[bool, str]:
    """Whether a local cluster can be started here; the reason when it cannot."""
    missing = [
        b
        for b in ("slurmctld", "slurmd", "munged", "munge", "sbatch", "scontrol", "sinfo", "squeue")
        if shutil.which(b, path=_SEARCH_PATH) is None
    ]
    if missing:
        return False, (
            f"SLURM not installed: {', '.join(missing)} not found "
            "(Debian: apt-get install slurm-wlm munge)"
        )
    if not SCRIPT.is_file():
        return False, f"{SCRIPT} is missing"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return False, "the local SLURM cluster needs root (slurmctld/slurmd run as root)"
    return True, ""


def require_slurm_or_skip() -> None:
    """Skip the calling test/fixture without SLURM; fail instead when REQUIRE_SLURM=1."""
    import pytest

    ok, reason = slurm_available()
    if ok:
        return
    if os.environ.get("REQUIRE_SLURM") == "1":
        pytest.fail(f"REQUIRE_SLURM=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def multinode_available(nodes: int = 2) -> tuple[bool, str]:
    """Whether this machine permits a local cluster of ``nodes`` nodes (root, network and UTS
    namespaces, veth pairs, a bridge: ``slurm_local_cluster.sh check``); the reason when it does not."""
    proc = subprocess.run(["bash", str(SCRIPT), "check", "--nodes", str(nodes)], capture_output=True, text=True,
                          env=script_env(), stdin=subprocess.DEVNULL, timeout=60)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return False, lines[-1] if lines else f"slurm_local_cluster.sh check failed (exit {proc.returncode})"
    return True, ""


def require_multinode_or_skip(nodes: int = 2) -> None:
    """Skip without SLURM or namespaces; fail instead under REQUIRE_SLURM=1 or REQUIRE_MULTINODE=1."""
    import pytest

    require_slurm_or_skip()
    ok, reason = multinode_available(nodes)
    if ok:
        return
    if os.environ.get("REQUIRE_MULTINODE") == "1":
        pytest.fail(f"REQUIRE_MULTINODE=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def script_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment slurm_local_cluster.sh runs in: this one, the daemons' folders on PATH, plus ``extra``."""
    env = dict(os.environ)
    env["PATH"] = _SEARCH_PATH
    # A SLURM_CONF from the caller must not leak into the script's own checks.
    env.pop("SLURM_CONF", None)
    env.update(extra or {})
    return env


def start_local_slurm(state_dir: Path, timeout_s: float = 120, nodes: int = 1,
                      extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Start (or reuse) the cluster of ``nodes`` nodes whose files live in ``state_dir``.

    ``extra_env`` adds variables for the script (e.g. LOCAL_SLURM_REQUEUE_DELAY).
    Returns the environment variables a client needs (``SLURM_CONF``).
    Raises SlurmError with the script's output (which includes the last log
    lines) when the cluster does not come up.
    """
    state_dir = Path(state_dir)
    try:
        proc = subprocess.run(
            ["bash", str(SCRIPT), "start", "--nodes", str(nodes), str(state_dir)],
            capture_output=True,
            text=True,
            env=script_env(extra_env),
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        raise SlurmError(f"{SCRIPT.name} start did not finish in {timeout_s}s") from exc
    if proc.returncode != 0:
        raise SlurmError(
            f"{SCRIPT.name} start {state_dir} failed (exit {proc.returncode}):\n"
            f"{proc.stderr}{proc.stdout}"
        )
    env: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        m = re.fullmatch(r"\s*export\s+([A-Za-z_][A-Za-z0-9_]*)=(.*)", line)
        if m:
            env[m.group(1)] = m.group(2).strip().strip("'\"")
    if "SLURM_CONF" not in env:
        raise SlurmError(f"{SCRIPT.name} start printed no SLURM_CONF:\n{proc.stdout}")
    _active_env.clear()
    _active_env.update(env)
    return env


def stop_local_slurm(state_dir: Path, timeout_s: float = 120) -> None:
    """Cancel the cluster's jobs and stop its daemons (and munged if it started it)."""
    proc = subprocess.run(
        ["bash", str(SCRIPT), "stop", str(state_dir)],
        capture_output=True,
        text=True,
        env=script_env(),
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )
    conf = str(Path(state_dir) / "slurm.conf")
    if _active_env.get("SLURM_CONF") in (conf, os.path.realpath(conf)):
        _active_env.clear()
    if proc.returncode != 0:
        raise SlurmError(f"{SCRIPT.name} stop {state_dir} failed:\n{proc.stderr}{proc.stdout}")


@contextlib.contextmanager
def running_local_slurm(state_dir: Path, nodes: int = 1,
                        extra_env: Mapping[str, str] | None = None) -> Iterator[dict[str, str]]:
    """Context manager: start the cluster, yield its env, always stop it."""
    try:
        yield start_local_slurm(state_dir, nodes=nodes, extra_env=extra_env)
    finally:
        stop_local_slurm(state_dir)


def on_node(state_dir: Path, node: str, command: Sequence[str], env: Mapping[str, str] | None = None,
            cwd: Path | str | None = None) -> subprocess.Popen:
    """Start ``command`` on one node of a several-node cluster (``slurm_local_cluster.sh exec``): in that
    node's namespaces, so it has the node's hostname, address, /etc/hosts and TMPDIR."""
    return subprocess.Popen(["bash", str(SCRIPT), "exec", str(state_dir), node, *command], cwd=cwd,
                            env=slurm_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)


def node_addr(node: str, env: Mapping[str, str] | None = None) -> str:
    """The address SLURM reaches ``node`` at (its NodeAddr)."""
    line = _run(["scontrol", "show", "node", "-o", node], env=env).stdout
    found = re.search(r"\bNodeAddr=(\S+)", line)
    if not found:
        raise SlurmError(f"scontrol shows no NodeAddr for {node}: {line!r}")
    return found.group(1)


def node_states(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every node's state as sinfo shows it, e.g. {"node0": "idle"}."""
    out = _run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


def update_job(job_id: str, env: Mapping[str, str] | None = None, **fields: str) -> None:
    """``scontrol update JobId=<id> Field=value ...`` (e.g. NumNodes="1-1", TimeLimit="10")."""
    _run(["scontrol", "update", f"JobId={job_id}", *(f"{key}={value}" for key, value in fields.items())], env=env)


# A distributed launch's variables in the test process (left by an in-process run) must not reach a
# job: sbatch exports its environment, and a MASTER_PORT there overrides the job's own.
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def slurm_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """os.environ without :data:`LAUNCH_VARIABLES` + the last started cluster's variables + ``env``."""
    merged = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    merged["PATH"] = _SEARCH_PATH
    merged.update(_active_env)
    if env:
        merged.update(env)
    return merged


def _run(cmd: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | str | None = None,
         check: bool = True, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        list(cmd),
        capture_output=True,
        text=True,
        env=slurm_env(env),
        cwd=cwd,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )
    if check and proc.returncode != 0:
        raise SlurmError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def sbatch(
    script: Path | str | None = None,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    script_args: Sequence[str] = (),
) -> str:
    """Submit a batch job and return its id.

    ``script`` is a path to a batch script (None with ``args=["--wrap", cmd]``);
    ``args`` are sbatch options, ``script_args`` go to the script. ``env`` is
    added to os.environ and the cluster's variables for the submission (and,
    with sbatch's default ``--export=ALL``, for the job).
    """
    cmd = ["sbatch", "--parsable", *args]
    if script is not None:
        cmd += [str(script), *script_args]
    out = _run(cmd, env=env, cwd=cwd).stdout.strip()
    job_id = out.splitlines()[-1].split(";")[0] if out else ""
    if not job_id.isdigit():
        raise SlurmError(f"unexpected sbatch output: {out!r}")
    return job_id


def job_info(job_id: str, env: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """``scontrol show job`` as a dict (None when slurmctld no longer knows the job)."""
    proc = _run(["scontrol", "show", "job", "-o", str(job_id)], env=env, check=False)
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            return None
        raise SlurmError(f"scontrol show job {job_id} failed: {proc.stderr.strip()}")
    line = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""
    return dict(re.findall(r"(?:^|\s)([A-Za-z][A-Za-z0-9/:_]*)=(\S*)", line))


_sacct_works: dict[str, bool] = {}


def _accounting_works(env: Mapping[str, str] | None) -> bool:
    key = slurm_env(env).get("SLURM_CONF", "")
    if key not in _sacct_works:
        proc = _run(["sacct", "-n", "-X", "-o", "JobID", "-S", "now-1minute"], env=env, check=False)
        _sacct_works[key] = proc.returncode == 0 and "disabled" not in proc.stderr.lower()
    return _sacct_works[key]


def _sacct_field(job_id: str, field: str, env: Mapping[str, str] | None) -> str | None:
    if not _accounting_works(env):
        return None
    proc = _run(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", field], env=env, check=False)
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    return lines[-1] if proc.returncode == 0 and lines else None


def job_state(job_id: str, env: Mapping[str, str] | None = None) -> str:
    """The job's state, e.g. PENDING, RUNNING, COMPLETED ("UNKNOWN" if forgotten)."""
    info = job_info(job_id, env)
    if info is not None and "JobState" in info:
        return info["JobState"]
    state = _sacct_field(job_id, "State", env)
    # sacct writes e.g. "CANCELLED by 0".
    return state.split()[0] if state else "UNKNOWN"


def job_restart_count(job_id: str, env: Mapping[str, str] | None = None) -> int:
    """How many times the job was requeued (scontrol's Restarts=)."""
    info = job_info(job_id, env)
    if info is None or "Restarts" not in info:
        raise SlurmError(f"scontrol no longer knows job {job_id}; its restart count is unknown")
    return int(info["Restarts"])


def wait_for_job(
    job_id: str,
    timeout_s: float = 60,
    env: Mapping[str, str] | None = None,
    poll_s: float = 0.5,
) -> str:
    """Wait until the job reaches a final state (COMPLETED, FAILED, ...) and return it.

    A requeued job passes through PENDING again; that is not final. Raises
    TimeoutError (with the job's last scontrol record) after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    state = "UNKNOWN"
    while time.monotonic() < deadline:
        state = job_state(job_id, env)
        if state in FINAL_STATES:
            return state
        time.sleep(poll_s)
    info = job_info(job_id, env)
    raise TimeoutError(f"job {job_id} still {state} after {timeout_s}s: {info}")


def wait_for_state(
    job_id: str,
    states: Sequence[str],
    timeout_s: float = 60,
    env: Mapping[str, str] | None = None,
    poll_s: float = 0.2,
) -> str:
    """Wait until the job is in one of ``states`` (or a final state); return the state."""
    deadline = time.monotonic() + timeout_s
    state = "UNKNOWN"
    while time.monotonic() < deadline:
        state = job_state(job_id, env)
        if state in states or state in FINAL_STATES:
            return state
        time.sleep(poll_s)
    raise TimeoutError(f"job {job_id} still {state} after {timeout_s}s (wanted {list(states)})")


def wait_for_file(path: Path, timeout_s: float = 30, contains: str | None = None) -> str:
    """Wait until ``path`` exists (and contains ``contains``); return its text."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            text = path.read_text(errors="replace")
            if contains is None or contains in text:
                return text
        time.sleep(0.2)
    raise TimeoutError(f"{path} did not appear{'' if contains is None else f' with {contains!r}'} in {timeout_s}s")


def signal_batch(job_id: str, signal: str = "USR1", env: Mapping[str, str] | None = None) -> None:
    """Send ``signal`` to the job's batch shell only (``scancel --signal=SIG --batch``)."""
    _run(["scancel", f"--signal={signal}", "--batch", str(job_id)], env=env)


def cancel(job_id: str, env: Mapping[str, str] | None = None) -> None:
    _run(["scancel", str(job_id)], env=env, check=False)
