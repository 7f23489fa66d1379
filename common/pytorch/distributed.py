"""Process-group set-up from torchrun's variables, SLURM's, or neither (one process).

- torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
- ``srun`` without torchrun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the master is the allocation's
  first node and the port comes from the job id, so two jobs on one node do not collide.
- Neither: a single process, no group.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import socket
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (before any group exists: see shutdown_distributed)

from common.config import COLLECTIVE_TIMEOUT_S
from common.errors import UserError

_joined_a_group = False
_timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)  # the process group's: groups made later get it too


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands: its rank, the world, its device and how it was launched."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    launcher: str  # "torchrun", "slurm" or "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _scontrol(*args: str) -> str:
    """``scontrol``'s output, or "" when it is missing or fails."""
    try:
        return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""


def _slurm_master_addr() -> str:
    """The job's first node by its NodeAddr: its name may not resolve everywhere, or to SLURM's interface."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if nodelist:
        hosts = _scontrol("show", "hostnames", nodelist).split()
        if hosts:
            node_addr = re.search(r"\bNodeAddr=(\S+)", _scontrol("show", "node", "-o", hosts[0]))
            return node_addr.group(1) if node_addr else hosts[0]
    return os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")


def _launch_env() -> tuple[int, int, int, str]:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return (
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", 0)),
            "torchrun",
        )
    if "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        os.environ.setdefault("MASTER_ADDR", _slurm_master_addr())
        os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000))
        return (
            int(os.environ["SLURM_PROCID"]),
            int(os.environ["SLURM_NTASKS"]),
            int(os.environ.get("SLURM_LOCALID", 0)),
            "slurm",
        )
    return 0, 1, 0, "single"


def launch_rank() -> int:
    """This process's rank as its launcher set it (0 for a single process)."""
    return _launch_env()[0]


def wants_cuda(preference: str) -> bool:
    """Whether ``device=preference`` will train on CUDA (answered without starting CUDA)."""
    return preference == "cuda" or (preference == "auto" and torch.cuda.is_available())


def _gpu_index(local_rank: int, launcher: str) -> int:
    """This process's GPU on its node; ``UserError`` when a node has more processes than GPUs.

    (Two ranks on one GPU would make NCCL fail with "Duplicate GPU detected".)
    """
    gpus = torch.cuda.device_count()
    if launcher == "slurm" and gpus == 1:
        return 0  # srun --gpus-per-task=1: each task sees its own GPU as device 0
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))  # torchrun sets it
    if processes > gpus:
        raise UserError(f"{processes} processes on this node but {gpus} GPU(s) visible: start at most {gpus} "
                        f"per node (torchrun --nproc-per-node, srun --ntasks-per-node) or use device=cpu")
    return local_rank


def resolve_device(preference: str, local_rank: int = 0, launcher: str = "single") -> torch.device:
    """This process's device for ``device=preference``; sets the current CUDA device.

    ``auto``: CUDA when present, else CPU. Raises ``UserError`` for ``cuda`` without a GPU or an unknown value."""
    if preference not in ("auto", "cpu", "cuda"):
        raise UserError(f"device must be auto, cpu or cuda, not {preference!r}")
    if preference == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda was asked for but no CUDA GPU is visible; use device=cpu or device=auto")
    if not wants_cuda(preference):
        return torch.device("cpu")
    index = _gpu_index(local_rank, launcher)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def process_group_backend(device: torch.device, cpu_collectives: bool = False) -> str:
    """gloo on the CPU; nccl on CUDA, plus gloo with ``cpu_collectives`` (host tensors: offloaded FSDP shards)."""
    if device.type != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if cpu_collectives else "nccl"


NCCL_TRACE_PREFIX = "nccl_trace_rank_"
"""The file names NCCL's flight recorder dumps to in a run's hang folder (torch appends the rank)."""


def _enable_flight_recorder(hang_dir: Path) -> None:
    """Turn on NCCL's flight recorder, dumping to ``hang_dir/nccl_trace_rank_<N>`` on a timeout.

    - Call before an NCCL group is made; variables already set win.
    - Read with ``python -m torch.distributed.flight_recorder.fr_trace <hang_dir> --prefix nccl_trace_rank_``.
    """
    hang_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(hang_dir / NCCL_TRACE_PREFIX))


def init_distributed(device_preference: str = "auto", timeout_s: float = COLLECTIVE_TIMEOUT_S,
                     cpu_collectives: bool = False, group_of_one: bool = False,
                     hang_dir: Path | None = None) -> DistInfo:
    """Join the process group when launched with several processes; this process's :class:`DistInfo`.

    - ``timeout_s``: a collective waiting longer fails (``trainer.collective_timeout_s``; see
      ``common/records/heartbeat.py``).
    - ``cpu_collectives``: gloo beside nccl (:func:`process_group_backend`).
    - ``group_of_one``: a group even for one process, so code written for a group (FSDP2) runs on one GPU.
    - ``hang_dir``: where an NCCL group's flight recorder dumps (:func:`_enable_flight_recorder`).
    """
    global _joined_a_group, _timeout
    rank, world_size, local_rank, launcher = _launch_env()
    device = resolve_device(device_preference, local_rank, launcher)
    if (world_size > 1 or group_of_one) and not dist.is_initialized():
        _joined_a_group = True
        _timeout = timedelta(seconds=timeout_s)
        alone = world_size == 1 and "MASTER_PORT" not in os.environ
        backend = process_group_backend(device, cpu_collectives)
        if hang_dir is not None and "nccl" in backend:
            _enable_flight_recorder(hang_dir)
        dist.init_process_group(  # a group of one meets at a free local port, leaving the environment alone
            backend=backend,
            init_method=f"tcp://127.0.0.1:{free_port()}" if alone else None,
            rank=rank,
            world_size=world_size,
            timeout=_timeout,
            device_id=device if device.type == "cuda" else None,
        )
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, launcher=launcher)


def gloo_group() -> dist.ProcessGroup:
    """A new gloo group of every rank, with the process group's timeout (not gloo's 30-minute default).

    Collective: every rank calls it."""
    return dist.new_group(backend="gloo", timeout=_timeout)


def joined_a_group() -> bool:
    """Whether :func:`init_distributed` made this process part of a process group."""
    return _joined_a_group


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def shutdown_distributed() -> None:
    """Destroy every process group and free it while the interpreter still runs.

    - Why: a gloo worker thread still freeing its last collective's tensors at interpreter shutdown
      needs the GIL; Python 3.11 ends it with ``pthread_exit`` and the C++ unwinding aborts a finished
      run (``terminate called without an active exception``, exit -6).
    - So nothing may keep a group alive past this call: ``torch.distributed.nn`` is imported with this
      module, before any group exists (its functions default to ``group=group.WORLD`` evaluated at import,
      and ``torch.optim`` imports it via ``torch._dynamo``); and the garbage collector runs here, freeing
      groups held only by dead objects (a DDP model).
    - PyTorch still holds a group FSDP2 used (DTensor's caches keep its device mesh), so a process that
      joined a group ends without interpreter shutdown (:func:`common.entry.exit_process`).
    """
    if dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj: object, src: int = 0) -> object:
    """Rank ``src``'s value on every rank (the identity in a single process)."""
    if not dist.is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def on_device(model: torch.nn.Module, device: torch.device, channels_last: bool) -> torch.nn.Module:
    """``model`` on this process's device, in the channels-last memory format when asked for."""
    model = model.to(device)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def data_parallel(model: torch.nn.Module, dist_info: DistInfo, out_of_memory: str = "stop") -> torch.nn.Module:
    """``model`` in DistributedDataParallel across the ranks (itself on one process).

    - ``out_of_memory="halve"``: a rank may redo a step alone (``common/run/out_of_memory.py``), so
      forward and backward must make no collective: the model is not wrapped, rank 0's weights and
      buffers are broadcast once, and the run calls :func:`all_reduce_gradients` after the step.
    """
    if not dist_info.distributed:
        return model
    if out_of_memory == "halve":
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor, 0)
        return model
    device_ids = [dist_info.device.index] if dist_info.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


def all_reduce_gradients(model: torch.nn.Module) -> None:
    """Average ``model``'s gradients over the ranks as DDP does (divide, then sum), bucketed per dtype."""
    world_size = dist.get_world_size()
    gradients = [parameter.grad for parameter in model.parameters() if parameter.grad is not None]
    for dtype in sorted({gradient.dtype for gradient in gradients}, key=str):
        bucket: list[torch.Tensor] = []
        for gradient in [*(g for g in gradients if g.dtype == dtype), None]:
            if gradient is not None:
                bucket.append(gradient)
            full = gradient is None or sum(g.numel() for g in bucket) * gradient.element_size() >= _BUCKET_BYTES
            if bucket and full:
                flat = torch._utils._flatten_dense_tensors(bucket).div_(world_size)
                dist.all_reduce(flat)
                torch._foreach_copy_(bucket, torch._utils._unflatten_dense_tensors(flat, bucket))
                bucket = []


def gradient_sync(model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """The context for a micro-batch's backward: DDP and FSDP2 reduce gradients only when ``sync`` (the last one)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if sync or not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()


def broadcast_buffers(module: torch.nn.Module, src: int = 0) -> None:
    """Rank ``src``'s buffers (BatchNorm running statistics) on every rank, one broadcast per dtype.

    - Why: after a step each rank's buffers (and its EMA's) differ; rank 0's are checkpointed, so an
      evaluation on every rank's own would score a mix of models, and another after a resume.
    - Training is unchanged: DDP starts each forward from rank 0's buffers anyway.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    buffers = list(module.buffers())
    for dtype in sorted({buffer.dtype for buffer in buffers}, key=str):
        group = [buffer for buffer in buffers if buffer.dtype == dtype]
        flat = torch.cat([buffer.detach().reshape(-1) for buffer in group])
        dist.broadcast(flat, src)
        for buffer, value in zip(group, flat.split([buffer.numel() for buffer in group])):
            buffer.copy_(value.view_as(buffer))


def all_gather_object(obj: object) -> list:
    if not dist.is_initialized():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
