"""Test-only hooks for runs the tests start: pause a training run right after a chosen checkpoint
(tests/resume.py), so that a SIGKILL or a stop signal lands exactly there, however fast or loaded
the machine is; make a chosen training step non-finite (tests/test_divergence.py); and make one
run out of memory (tests/test_records.py).

Python imports this module at start-up when its folder (and the repository) is on PYTHONPATH.
With PAUSE_AT_STEP=<n> and PAUSE_MARKER=<file> set, it patches the checkpoint manager of every
process started so, and each process that saves (every rank) does this at its first
``CheckpointManager.save`` of a step ``>= n``:

* by default, once that save has returned and its checkpoint is committed (a background write
  included), rank 0 writes the step to the marker file; then the process waits until SIGTERM or
  SIGUSR1 has reached it, and forever otherwise. The test SIGKILLs it there, or sends the signal,
  after which the run goes on, sees the signal at its next step and stops there;
* with PAUSE_HOW=after-evaluation, the same at the first save of such a step that carries
  metrics (an epoch's end, saved again with its evaluation);
* with PAUSE_HOW=mid-write (for ``checkpoint.async_save=true``), the background writer stops in
  the middle of writing that checkpoint's ``state.pt`` and writes the marker; the training loop
  goes on until its next save waits for the writer. A SIGKILL then lands in a real write;
* a process started once the marker exists does not pause (a requeued job, say), nor does one
  whose checkpoint directory does not contain PAUSE_ONLY_IN, when that is set (one job of a sweep).

With NONFINITE_AT_STEP=<k>, the training loss of optimizer step ``k`` (its first micro-batch's
``F.cross_entropy``, in training only) is made NaN (NONFINITE_HOW=loss) or, with
NONFINITE_HOW=grad, stays finite while its gradient becomes infinite (what fp16 overflow does);
on rank NONFINITE_RANK only when that is set, and NONFINITE_TIMES times in a process (default 1;
0: every time the run reaches step ``k``, after a rollback too).

With OOM_AT_STEP=<k>, the first training ``F.cross_entropy`` of optimizer step ``k`` raises
``torch.OutOfMemoryError`` with CUDA's message, as a GPU that ran out of memory there would, once
in a process (``trainer.out_of_memory=halve`` redoes the step), on rank OOM_RANK only when that is set.

With STALL_AT_STEP=<k>, rank STALL_RANK (default 1) never finishes optimizer step ``k``: its first
training ``F.cross_entropy`` there calls :func:`stall_in_step`, which sleeps for ever (in Python, so
that its threads and signal handlers run) or, with STALL_HOW=freeze, stops the whole process
(SIGSTOP: not even its heartbeat thread runs) a second later, once its heartbeat has recorded where
it is; meanwhile the other ranks wait in the step's collectives (tests/test_hangs.py).

With PRINT_COMPILE_COUNTERS=1, a process that compiled prints ``COMPILE_COUNTERS {json}`` when it
exits: the compiler's counters (``torch._dynamo.utils.counters``; Inductor's FX graph cache hits and
misses among them) (tests/test_compile_cache.py). Inductor's compile workers print nothing.
"""

import os

if os.environ.get("PAUSE_AT_STEP") and not os.path.exists(os.environ["PAUSE_MARKER"]):
    import threading
    import time
    from pathlib import Path

    import common.checkpoint.writer as checkpoint_module
    from common.checkpoint.manager import CheckpointManager
    from common.run.training_run import StopSignals

    PAUSE_AT = int(os.environ["PAUSE_AT_STEP"])
    MARKER = Path(os.environ["PAUSE_MARKER"])
    HOW = os.environ.get("PAUSE_HOW", "after-save")
    ONLY_IN = os.environ.get("PAUSE_ONLY_IN", "")
    MID_WRITE = HOW == "mid-write"
    signalled = threading.Event()
    paused = threading.Event()
    writing_paused_step = threading.local()

    def mark(step: int) -> None:
        temporary = MARKER.with_name(MARKER.name + ".tmp")
        temporary.write_text(f"{step}\n")
        temporary.rename(MARKER)

    real_handle = StopSignals._handle

    def handle_and_note(self: StopSignals, signum: int, frame: object) -> None:
        real_handle(self, signum, frame)
        signalled.set()

    StopSignals._handle = handle_and_note

    real_save = CheckpointManager.save

    def save_then_pause(self: CheckpointManager, step: int, state: dict, metrics: dict | None = None,
                        *args: object, **kwargs: object) -> None:
        args = (state, metrics, *args)
        if (paused.is_set() or step < PAUSE_AT or (HOW == "after-evaluation" and not metrics)
                or ONLY_IN not in str(self.directory)):
            real_save(self, step, *args, **kwargs)
            return
        paused.set()
        if MID_WRITE:
            self._pause_write_of = step
            real_save(self, step, *args, **kwargs)
            return
        real_save(self, step, *args, **kwargs)
        self.wait()  # a background write is committed too
        if self.is_main:
            mark(step)
        while not signalled.is_set():
            time.sleep(0.05)

    CheckpointManager.save = save_then_pause

    real_write = CheckpointManager._write

    def write_with_pause(self: CheckpointManager, tmp: Path, final: Path, state: dict, manifest: dict,
                         *args: object) -> None:
        if getattr(self, "_pause_write_of", None) == manifest["step"]:
            writing_paused_step.step = manifest["step"]
        try:
            real_write(self, tmp, final, state, manifest, *args)
        finally:
            writing_paused_step.step = None

    CheckpointManager._write = write_with_pause

    real_chunk = checkpoint_module._HashingWriter.write

    def write_chunk_then_hang(self: object, data: bytes) -> int:
        written = real_chunk(self, data)
        step = getattr(writing_paused_step, "step", None)
        if step is not None:
            self.flush()
            mark(step)
            threading.Event().wait()  # the background writer: the training loop goes on
        return written

    checkpoint_module._HashingWriter.write = write_chunk_then_hang


if os.environ.get("NONFINITE_AT_STEP"):
    import torch
    import torch.nn.functional as F

    from common.run.training_run import TrainingRun

    NONFINITE_AT = int(os.environ["NONFINITE_AT_STEP"])
    NONFINITE_HOW = os.environ.get("NONFINITE_HOW", "loss")
    NONFINITE_RANK = os.environ.get("NONFINITE_RANK")
    NONFINITE_TIMES = int(os.environ.get("NONFINITE_TIMES", "1"))
    runs: list[TrainingRun] = []
    fired: list[tuple[int, int]] = []  # (rollbacks so far, step) of each pass through step k that fired

    class InfiniteGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, value: torch.Tensor) -> torch.Tensor:
            return value.clone()

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
            return grad * float("inf")

    real_init = TrainingRun.__init__

    def init_and_note(self: TrainingRun, *args: object, **kwargs: object) -> None:
        real_init(self, *args, **kwargs)
        runs.append(self)

    TrainingRun.__init__ = init_and_note
    real_cross_entropy = F.cross_entropy

    def cross_entropy(*args: object, **kwargs: object) -> torch.Tensor:
        loss = real_cross_entropy(*args, **kwargs)
        run = runs[-1] if runs else None
        if run is None or not torch.is_grad_enabled() or run.progress.step + 1 != NONFINITE_AT:
            return loss
        if NONFINITE_RANK is not None and run.dist_info.rank != int(NONFINITE_RANK):
            return loss
        this_pass = (len(run.progress.rollbacks), run.progress.step)
        if this_pass in fired or (NONFINITE_TIMES and len(fired) >= NONFINITE_TIMES):
            return loss
        fired.append(this_pass)
        return InfiniteGradient.apply(loss) if NONFINITE_HOW == "grad" else loss * float("nan")

    F.cross_entropy = cross_entropy


if os.environ.get("OOM_AT_STEP"):
    import torch
    import torch.nn.functional as F

    from common.run.training_run import TrainingRun

    OOM_AT = int(os.environ["OOM_AT_STEP"])
    OOM_RANK = os.environ.get("OOM_RANK")
    oom_runs: list[TrainingRun] = []
    oom_raised: list[int] = []
    real_oom_init = TrainingRun.__init__

    def init_and_note_for_oom(self: TrainingRun, *args: object, **kwargs: object) -> None:
        real_oom_init(self, *args, **kwargs)
        oom_runs.append(self)

    TrainingRun.__init__ = init_and_note_for_oom
    cross_entropy_before_oom = F.cross_entropy

    def cross_entropy_or_oom(*args: object, **kwargs: object) -> torch.Tensor:
        run = oom_runs[-1] if oom_runs else None
        if (run is not None and torch.is_grad_enabled() and run.progress.step + 1 == OOM_AT and not oom_raised
                and (OOM_RANK is None or run.dist_info.rank == int(OOM_RANK))):
            oom_raised.append(OOM_AT)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                         "capacity of 79.19 GiB of which 1.06 GiB is free.")
        return cross_entropy_before_oom(*args, **kwargs)

    F.cross_entropy = cross_entropy_or_oom


if os.environ.get("STALL_AT_STEP"):
    import signal
    import time

    import torch
    import torch.nn.functional as F

    from common.run.training_run import TrainingRun

    STALL_AT = int(os.environ["STALL_AT_STEP"])
    STALL_RANK = int(os.environ.get("STALL_RANK", "1"))
    FREEZE = os.environ.get("STALL_HOW") == "freeze"
    stalling_runs: list[TrainingRun] = []

    def stall_in_step() -> None:
        """Never return: the frame the stalled rank's stacks must show."""
        if FREEZE:
            time.sleep(1)
            os.kill(os.getpid(), signal.SIGSTOP)
        while True:
            time.sleep(0.05)

    real_stall_init = TrainingRun.__init__

    def init_and_note_for_stall(self: TrainingRun, *args: object, **kwargs: object) -> None:
        real_stall_init(self, *args, **kwargs)
        stalling_runs.append(self)

    TrainingRun.__init__ = init_and_note_for_stall
    cross_entropy_before_stall = F.cross_entropy

    def cross_entropy_or_stall(*args: object, **kwargs: object) -> torch.Tensor:
        run = stalling_runs[-1] if stalling_runs else None
        if (run is not None and torch.is_grad_enabled() and run.dist_info.rank == STALL_RANK
                and run.progress.step + 1 == STALL_AT):
            stall_in_step()
        return cross_entropy_before_stall(*args, **kwargs)

    F.cross_entropy = cross_entropy_or_stall


if os.environ.get("PRINT_COMPILE_COUNTERS"):
    import atexit
    import json

    def print_compile_counters() -> None:
        from torch._dynamo.utils import counters

        if counters["frames"]:
            print("COMPILE_COUNTERS " + json.dumps({group: dict(values) for group, values in counters.items()}),
                  flush=True)

    atexit.register(print_compile_counters)
