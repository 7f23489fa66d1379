"""``make doctor``: the launcher's pre-flight checks on this machine, as a table.

    python -m cluster.doctor [--nproc 2] [--backend gloo|nccl]

Rows: the Python environment, GPUs and free memory, every recipe's config and data, local
TCP, a 2-process all-reduce through torchrun (the launcher's own check), and the SLURM and
shell tools the cluster files use. FAIL rows make the exit code 1; WARN rows (no data yet, no
SLURM client) do not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Callable

from cluster import preflight

OK, WARN, FAIL = "ok", "WARN", "FAIL"


def _row(name: str, check: Callable[[], str], failure: str = FAIL) -> tuple[str, str, str]:
    try:
        return name, OK, check()
    except preflight.CheckFailed as problem:
        return name, failure, str(problem)


def _allreduce(nproc: int, backend: str) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "cluster.preflight", "allreduce", "--backend", backend, "--timeout", "60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=preflight.REPO, env=env, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        last = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise preflight.CheckFailed(f"torchrun with {nproc} {backend} processes failed: {last}")
    return result.stdout.strip().removeprefix("preflight: ")


def _tools(*names: str) -> str:
    missing = [name for name in names if shutil.which(name) is None]
    if missing:
        raise preflight.CheckFailed(f"not found: {', '.join(missing)}")
    return "found: " + ", ".join(names)


def run_checks(nproc: int, backend: str) -> list[tuple[str, str, str]]:
    rows = [_row("python env", preflight.check_python_env)]
    if rows[0][1] == FAIL:
        return rows  # nothing below can run without torch and hydra
    rows.append(_row("gpus", lambda: preflight.check_gpus(nproc, backend)))
    for recipe in preflight.recipes():
        rows.append(_row(f"config {recipe}", lambda r=recipe: preflight.check_config(r, [])))
        if rows[-1][1] == OK:
            rows.append(_row(f"data {recipe}", lambda r=recipe: preflight.check_data(r, []), failure=WARN))
    rows.append(_row("tcp loopback", preflight.check_loopback_tcp))
    rows.append(_row(f"all-reduce x{nproc}", lambda: _allreduce(nproc, backend)))
    rows.append(_row("slurm client", lambda: _tools("sbatch", "scontrol", "srun"), failure=WARN))
    return rows


def format_table(rows: list[tuple[str, str, str]]) -> str:
    width = max(len(name) for name, _, _ in rows)
    lines = [f"{'check':<{width}}  status  detail", f"{'-' * width}  ------  ------"]
    lines += [f"{name:<{width}}  {status:<6}  {detail}" for name, status, detail in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes for the all-reduce check")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                        help="default: nccl when GPUs are visible, else gloo")
    args = parser.parse_args(argv)
    backend = args.backend
    if backend is None:
        import torch

        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= args.nproc else "gloo"
    rows = run_checks(args.nproc, backend)
    print(format_table(rows))
    failed = [name for name, status, _ in rows if status == FAIL]
    if failed:
        print(f"\n{len(failed)} check(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
