"""Pre-flight checks before a (multi-node) launch, shared by ``cluster/launch.sh`` and ``make doctor``.

A job that fails an hour into its queue wait because a port is closed or a config key is
misspelt wastes the wait; these checks fail in seconds, each with one line that says what to
fix. ``cluster/launch.sh`` runs them on every node before torchrun::

    python -m cluster.preflight node --recipe R --nnodes N --node-rank K --master-addr A \
        --master-port P --nproc-per-node n --backend gloo [-- hydra overrides]
    torchrun ... -m cluster.preflight allreduce --backend gloo     # on every rank

Each check returns a short detail on success and raises :class:`CheckFailed` otherwise.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REQUIRED_MODULES = ("torch", "hydra", "omegaconf", "numpy")


class CheckFailed(Exception):
    """A pre-flight check failed; the message is the one line the user sees."""


def recipes() -> list[str]:
    """Recipes with a train.py and a primary config."""
    return sorted(p.parent.name for p in (REPO / "recipes").glob("*/train.py")
                  if (REPO / "conf" / f"{p.parent.name}.yaml").is_file())


def check_python_env(recipe: str | None = None) -> str:
    """The modules every recipe needs (and the recipe's own imports) load in this interpreter."""
    for module in REQUIRED_MODULES + ((f"recipes.{recipe}.train",) if recipe else ()):
        try:
            importlib.import_module(module)
        except Exception as error:  # any import-time failure is a broken environment
            raise CheckFailed(f"this Python ({sys.executable}) cannot import {module}: "
                              f"{type(error).__name__}: {error} (run `make setup`)") from error
    import torch
    from torch.distributed.launcher.api import LaunchConfig

    if "signals_to_handle" not in LaunchConfig.__dataclass_fields__:
        raise CheckFailed(f"torch {torch.__version__}: torchrun cannot forward SIGUSR1 to workers "
                          "(no --signals-to-handle); SLURM pre-emption needs a newer torch")
    return f"Python {sys.version.split()[0]}, torch {torch.__version__}"


def check_gpus(nproc_per_node: int, backend: str, min_free_gib: float = 1.0) -> str:
    """Enough visible GPUs for the processes, each with some free memory (nccl needs GPUs)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        if backend == "nccl":
            raise CheckFailed("BACKEND=nccl but no CUDA GPU is visible; use BACKEND=gloo to train on CPU")
        return "no GPU: CPU training with gloo"
    if backend == "nccl" and nproc_per_node > count:
        raise CheckFailed(f"NPROC_PER_NODE={nproc_per_node} but only {count} GPU(s) are visible")
    free = []
    for index in range(count):
        free_bytes, total_bytes = torch.cuda.mem_get_info(index)
        free.append(free_bytes / 2**30)
        if free_bytes / 2**30 < min_free_gib:
            raise CheckFailed(f"GPU {index} has only {free_bytes / 2**30:.1f} GiB free of "
                              f"{total_bytes / 2**30:.0f} GiB; another process is using it (nvidia-smi)")
    return f"{count} GPU(s) ({torch.cuda.get_device_name(0)}), free GiB: " + ", ".join(f"{f:.0f}" for f in free)


def check_config(recipe: str, overrides: list[str]) -> str:
    """The recipe's config composes and resolves with these overrides (the typed schema checks them)."""
    from common.entry import compose_config
    from common.errors import UserError

    if recipe not in recipes():
        raise CheckFailed(f"unknown recipe {recipe!r}; recipes: {', '.join(recipes())}")
    try:
        cfg = compose_config(recipe, overrides)
    except (UserError, ImportError) as error:
        raise CheckFailed(f"config {recipe}: {error}") from error
    return f"{recipe} config resolves (run_dir {cfg.run_dir})"


def check_data(recipe: str, overrides: list[str]) -> str:
    """The recipe's data root exists, or the folder of its shards with ``data.format=shards`` (their
    contents, and a remote, are checked by the recipe itself)."""
    from common.data.shards import local_folder
    from common.entry import compose_config

    data = compose_config(recipe, overrides).data
    root, shards = Path(data.root), data.get("format") == "shards"
    if shards:
        root = local_folder(str(data.shards.root))
        if root is None:
            return f"shards at {data.shards.root} (a remote: the run reads its index.json at start)"
    if not root.exists():
        has_prep = (REPO / "data_prep" / f"{recipe}.py").is_file()
        how = f"make prep-{recipe}{' FORMAT=shards' if shards else ''}" if has_prep else \
            f"see recipes/{recipe}/README.md"
        raise CheckFailed(f"{root} does not exist ({how})")
    return str(root)


def check_master_port_free(port: int) -> str:
    """On the master node: nothing else listens on the rendezvous port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as error:
            raise CheckFailed(f"master port {port} is already in use on this node ({error.strerror}); "
                              "pick another MASTER_PORT") from error
    return f"port {port} is free"


def check_master_reachable(addr: str, port: int, timeout_s: float) -> str:
    """On the other nodes: the master's port accepts TCP connections (retried until the timeout,
    because the master may start a little later)."""
    deadline = time.monotonic() + timeout_s
    reason = "no answer"
    while True:
        try:
            with socket.create_connection((addr, port), timeout=5):
                return f"{addr}:{port} reachable"
        except socket.gaierror as error:
            raise CheckFailed(f"cannot resolve the master address {addr!r}: {error.strerror}") from error
        except OSError as error:
            reason = os.strerror(error.errno) if error.errno else str(error)
            if error.errno not in (errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EHOSTUNREACH, None):
                reason = f"{reason} (errno {error.errno})"
        if time.monotonic() >= deadline:
            raise CheckFailed(f"cannot reach the master at {addr}:{port} over TCP within {timeout_s:g} s "
                              f"({reason.lower()}): start node 0 first, or check MASTER_ADDR, MASTER_PORT "
                              "and the firewall")
        time.sleep(1)


def check_loopback_tcp() -> str:
    """This machine accepts TCP connections on a local port (what a one-node rendezvous needs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
        except OSError as error:
            raise CheckFailed(f"cannot connect to 127.0.0.1:{port}: {error}") from error
    return f"127.0.0.1:{port} accepts connections"


def allreduce(backend: str, timeout_s: float) -> None:
    """Run on every rank under torchrun: one small all-reduce, its result checked."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from common.pytorch.distributed import shutdown_distributed

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    start = time.monotonic()
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        value = torch.full((1024,), float(rank + 1), device=device)
        dist.all_reduce(value)
        expected = world * (world + 1) / 2
        if not torch.all(value == expected):
            raise CheckFailed(f"all-reduce across {world} ranks gave {value[0].item()}, expected {expected}")
        if rank == 0:
            print(f"preflight: all-reduce ({backend}) across {world} ranks: ok "
                  f"({time.monotonic() - start:.1f} s with set-up)", flush=True)
    finally:
        shutdown_distributed()  # freed before the interpreter's shutdown, as a recipe's group is


def _run_node_checks(args: argparse.Namespace) -> None:
    checks = [
        ("python env", lambda: check_python_env(args.recipe)),
        ("gpus", lambda: check_gpus(args.nproc_per_node, args.backend, args.min_free_gib)),
        ("config", lambda: check_config(args.recipe, args.overrides)),
    ]
    if args.node_rank == 0:
        checks.append(("master port", lambda: check_master_port_free(args.master_port)))
    else:
        checks.append(("master reachable",
                       lambda: check_master_reachable(args.master_addr, args.master_port, args.connect_timeout)))
    for name, check in checks:
        print(f"preflight: {name}: {check()}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.preflight", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    node = commands.add_parser("node", help="checks one node runs before launching")
    node.add_argument("--recipe", required=True)
    node.add_argument("--nnodes", type=int, default=1)
    node.add_argument("--node-rank", type=int, default=0)
    node.add_argument("--master-addr", default="127.0.0.1")
    node.add_argument("--master-port", type=int, default=29500)
    node.add_argument("--nproc-per-node", type=int, default=1)
    node.add_argument("--backend", choices=("nccl", "gloo"), default="gloo")
    node.add_argument("--connect-timeout", type=float, default=300)
    node.add_argument("--min-free-gib", type=float, default=1.0)
    node.add_argument("overrides", nargs="*", help="hydra overrides (after --)")
    reduce = commands.add_parser("allreduce", help="run under torchrun: one all-reduce across all ranks")
    reduce.add_argument("--backend", choices=("nccl", "gloo"), default="gloo")
    reduce.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args(argv)
    try:
        if args.command == "node":
            _run_node_checks(args)
        else:
            allreduce(args.backend, args.timeout)
    except CheckFailed as failure:
        print(f"error: {failure}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
