"""The run contract, in one place: resume, checkpoints by steps, wall clock and signals, the
pre-emption exit, and the finish with ``summary.json``. A recipe hands :class:`TrainingRun` what a
checkpoint holds and keeps its own loop::

    run = TrainingRun.from_config(cfg, dist_info, plan, model=model, optimizer=optimizer, ...)
    progress = run.resume()                          # the newest valid checkpoint, if any; restores update it
    while not run.training_done():
        for group in run.steps(micro_batches):       # one optimizer step per group of micro-batches
            ...forward, backward, optimizer step...
            run.step_done(group.samples, grad_norm, loss=train_sums.running("loss"))
            ...log every trainer.log_every_steps: run.log_train(...)
        run.end_epoch(evaluate)                      # evaluates (when due) and saves
    run.finish(evaluate)                             # final evaluation, checkpoint, summary.json

What a resume restores and when it is bit-identical, signals and exit codes, divergence, early
stopping and ``init_from``: README "Outputs, resume and pre-emption" and "After training".
"""

from __future__ import annotations

import copy
import functools
import gc
import math
import signal
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.checkpoint.layout import improves, is_artifact_path, latest_checkpoint
from common.checkpoint.manager import KEEP_ALL, CheckpointManager, LoadedCheckpoint
from common.config import ProfileConfig, RunConfig, config_record
from common.data.sampler import ResumableDistributedSampler
from common.errors import EXIT_DIVERGED, Diverged, Preempted, UserError
from common.pytorch import distributed
from common.pytorch.distributed import DistInfo, all_reduce_gradients
from common.pytorch.metrics import SumMetrics
from common.pytorch.rng import rng_state, set_rng_state
from common.records import heartbeat
from common.records.loggers import RunLogger
from common.records.profiling import StepProfiler, out_of_memory_error
from common.records.provenance import bit_identity_differences, segment_record
from common.records.summary import output_lines, state_digest, write_summary
from common.records.telemetry import FlopCount, StepTelemetry, clip_grad_norm
from common.run.compile_cache import CompileCache
from common.run.divergence import NONE, NonfiniteWatch, all_finite, scale_learning_rate
from common.run.out_of_memory import (
    StepStart,
    check_can_halve,
    communicates_in_forward,
    device_description,
    drop_gradients,
    halved,
)
from common.run.search_trial import SearchTrial
from common.run.steps import EpochBatches, MicroBatches, StepPlan

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Taken over only when some Python code already handles it (submitit's requeue signal by default).
_LAUNCHER_SIGNALS = (signal.SIGUSR2,)


@dataclass
class Progress:
    """Counters that survive restarts."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # epoch in progress
    resumes: int = 0  # how many times this run was resumed from a checkpoint
    train_seconds: float = 0.0  # wall time spent in earlier segments of this run
    finished: bool = False  # the final checkpoint: restarting only rewrites the summary
    extra: dict[str, Any] = field(default_factory=dict)  # recipe-specific counters (e.g. stage)
    # Early stopping: the best checkpoint.best_metric evaluated so far, and evaluations since it.
    best_value: float | None = None
    evals_without_improvement: int = 0
    stopped_early: bool = False
    init_from: str = ""  # the weights the run started from (init_from=), kept when it resumes: for the summary
    rollbacks: list[dict[str, Any]] = field(default_factory=list)  # trainer.nonfinite=rollback: one record each
    pruned: dict[str, Any] | None = None  # a search's pruner stopped this trial: {"step", "epoch", "metric", "value"}
    # train/mfu: the model's FLOPs per sample in a training step, counted on the run's first step (again
    # after a new optimizer: dinov2's stage switch); kept, so a resumed run counts nothing.
    flops_per_sample: float | None = None
    # trainer.out_of_memory=halve: the micro-batch in use at the last save (0: trainer.batch_size), the device and
    # number of ranks it was found on (a resume elsewhere tries trainer.batch_size again), and one record per halving.
    micro_batch_size: int = 0
    micro_batch_found_on: str = ""
    out_of_memory: list[dict[str, Any]] = field(default_factory=list)

    def describe(self) -> str:
        """``step 12, epoch 3`` and the recipe's own counters (``stage finetune``)."""
        return ", ".join([f"step {self.step}", f"epoch {self.epoch}", *(f"{k} {v}" for k, v in self.extra.items())])

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Take the counters of a checkpoint (``asdict`` of a Progress) in place. In place, because
        the loop holds this object from :meth:`TrainingRun.resume` on: a restore that made a new one
        would leave the loop reading a step that no longer moves. Counters an earlier version kept
        and this one does not are ignored; those it lacks take their defaults."""
        known = {name: value for name, value in saved.items() if name in _PROGRESS_FIELDS}
        restored = Progress(**copy.deepcopy(known))
        for progress_field in fields(Progress):
            setattr(self, progress_field.name, getattr(restored, progress_field.name))


_PROGRESS_FIELDS = {progress_field.name for progress_field in fields(Progress)}


# ---- when to save and when to stop ------------------------------------------------------------


class StopSignals:
    """Records the first SIGTERM/SIGUSR1 (or a launcher's signal) instead of dying, so the step
    can finish and be checkpointed. A launcher's own handler is displaced too: submitit requeues on
    SIGUSR2 by raising ``SystemExit`` wherever the program is (inside ``torch.save``, a failed save
    and a failed job); it is handed the signal once the checkpoint is written (:meth:`hand_over`)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._received: int | None = None
        self._previous = {}
        claimed = [signum for signum in _LAUNCHER_SIGNALS if callable(signal.getsignal(signum))]
        for signum in (*STOP_SIGNALS, *claimed):
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self._received is None:
            self._received = signum
        self.signal_name = signal.Signals(signum).name

    @property
    def raised(self) -> bool:
        return self.signal_name is not None

    def hand_over(self) -> None:
        """Call the Python handler the first signal displaced, if any (submitit's requeue, which
        exits). For after the checkpoint: nothing of the run is lost whatever that handler does."""
        previous = self._previous.get(self._received) if self._received is not None else None
        if callable(previous):
            previous(self._received, None)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _host_group() -> dist.ProcessGroup | None:
    """A group that all-reduces host tensors: the default one when it has gloo (a CPU run, or
    ``cpu:gloo,cuda:nccl``), else a gloo group made for it. Collective: every rank calls it."""
    if "gloo" in dist.get_backend():
        return None
    return distributed.gloo_group()


@dataclass(frozen=True)
class Decision:
    save: bool
    stop: bool
    nonfinite_step: int = NONE  # the first step some rank knows to be non-finite (NONE: none)
    nonfinite_ranks: tuple[int, ...] = ()
    micro_batches: tuple[int, ...] = ()  # each rank's micro-batch (trainer.out_of_memory=halve), where they agreed


class CheckpointCadence:
    """Decides after each optimizer step whether to save and whether to stop, the same on every rank,
    or a collective would hang. The step cadence is the same everywhere by construction; the wall
    clock and signals are local, so every ``checkpoint.sync_every_steps`` steps the ranks agree with
    one tiny MAX all-reduce of a host tensor over gloo: it waits for the other ranks' processes,
    never for the GPU's queue (an nccl all-reduce read back on the host would drain it)."""

    def __init__(self, every_steps: int, every_seconds: float, sync_every_steps: int,
                 stop_signals: StopSignals) -> None:
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.sync_every_steps = max(1, sync_every_steps) if self.distributed else 1
        self.group = _host_group() if self.distributed else None
        self.stop_signals = stop_signals
        self.last_save = time.monotonic()

    def preempted(self, step: int) -> Preempted:
        """The exception raised once the checkpoint for a stop decision is written. A launcher's
        handler the signal displaced gets it first (submitit requeues and exits there)."""
        self.stop_signals.hand_over()
        received = self.stop_signals.signal_name or "a stop signal on another rank"
        return Preempted(f"received {received}: checkpoint saved at step {step}")

    def close(self) -> None:
        """Give the signals back to the handlers they had before."""
        self.stop_signals.restore()

    def saved(self) -> None:
        self.last_save = time.monotonic()

    def after_step(self, step: int, nonfinite: Callable[[], int], micro_batch: int) -> Decision:
        """``nonfinite()``: the first non-finite step this rank knows of (NONE: none), read only
        where the ranks agree (a :meth:`common.run.divergence.NonfiniteWatch.poll`); ``micro_batch``:
        the micro-batch this rank uses, which the ranks compare there too."""
        by_steps = self.every_steps > 0 and step % self.every_steps == 0
        if step % self.sync_every_steps != 0:
            return Decision(save=by_steps, stop=False)
        due = self.every_seconds > 0 and time.monotonic() - self.last_save >= self.every_seconds
        stop = self.stop_signals.raised
        rows = [[float(due), float(stop), float(nonfinite()), float(micro_batch)]]
        if self.distributed:
            mine = torch.tensor(rows[0], dtype=torch.float64)
            gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            with heartbeat.phase(heartbeat.CADENCE):
                dist.all_gather(gathered, mine, group=self.group)
            rows = [row.tolist() for row in gathered]
        due, stop = any(row[0] > 0 for row in rows), any(row[1] > 0 for row in rows)
        bad = {rank: int(row[2]) for rank, row in enumerate(rows) if row[2] != NONE}
        return Decision(save=by_steps or due or stop, stop=stop, nonfinite_step=min(bad.values(), default=NONE),
                        nonfinite_ranks=tuple(sorted(bad)), micro_batches=tuple(int(row[3]) for row in rows))


# ---- the run ------------------------------------------------------------------------------------


def _merged_halvings(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Several ranks' records of halved micro-batches (:attr:`Progress.out_of_memory`) as one list,
    a halving of several ranks once, with all of them."""
    merged: dict[tuple[int, int], dict[str, Any]] = {}
    for records in per_rank:
        for record in records:
            kept = merged.setdefault((record["step"], record["micro_batch_size"]), {**record, "ranks": []})
            kept["ranks"] = sorted(set(kept["ranks"]) | set(record["ranks"]))
    return [merged[key] for key in sorted(merged)]


def _merged_sums(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Several ranks' :meth:`~common.pytorch.metrics.SumMetrics.state_dict` added into one."""
    merged: dict[str, torch.Tensor] = {}
    for sums in per_rank:
        for name, value in sums.items():
            merged[name] = merged[name] + value.cpu() if name in merged else value.cpu()
    return merged


class TrainingRun:
    """One run's contract, built once from the objects a checkpoint holds.

    ``model`` is the plain module (not its DDP or ``torch.compile`` wrapper, which share its
    parameters). ``extra_state`` names more objects with ``state_dict``/``load_state_dict`` (an
    EMA model): each is checkpointed and its digest reported as ``<name>_digest``. With
    ``sharded=True`` the model and optimizer state go through ``torch.distributed.checkpoint``
    (each rank writes its FSDP shards; a checkpoint resumes on another number of ranks).
    ``milestones`` maps epochs to a reason: the checkpoint saved when that epoch ends is kept
    for good (``_force``). A recipe that starts a fresh optimizer mid-run (dinov2's stage switch)
    hands it over with :meth:`track_optimizer`. ``config`` (the run's config as plain data) is
    written into every checkpoint's manifest; ``model_cfg`` (its ``model`` node) tells
    ``init_from`` how this recipe names its tensors; ``init_from`` and ``init_skip_head``
    start a new run from another run's weights (``common/after_training/init_from.py``; a run that resumes its own
    checkpoint ignores them); ``early_stopping_patience`` ends training after that many evaluations
    without a better ``checkpoint.best_metric`` (the count is in :class:`Progress`). ``search_trial``:
    the search trial this run is, if any: it reports each epoch's evaluation and ends like an early
    stop when the study's pruner says so. ``log_every_steps``, ``grad_clip_norm``, ``precision``
    and ``deterministic`` are the ``trainer`` node's (:meth:`clip_grad_norm`, the telemetry of
    :meth:`log_train`, the provenance check of :meth:`resume`); ``profile`` the ``profile`` node.
    ``compile_cache`` (with ``trainer.compile``) is saved with every checkpoint and restored on resume.
    ``out_of_memory`` is ``trainer.out_of_memory`` (``halve``: :meth:`steps` hands a step that ran out of
    memory out again with half the micro-batch, ``common/run/out_of_memory.py``).
    """

    def __init__(
        self,
        dist_info: DistInfo,
        plan: StepPlan,
        checkpoints: CheckpointManager,
        cadence: CheckpointCadence,
        open_logger: Callable[[int], RunLogger],
        *,
        recipe: str,
        run_dir: str | Path,
        resume_from_checkpoint: bool,
        eval_every_epochs: int,
        model: torch.nn.Module,
        sampler: ResumableDistributedSampler,
        train_sums: SumMetrics,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        extra_state: dict[str, Any] | None = None,
        sharded: bool = False,
        milestones: dict[int, str] | None = None,
        config: dict[str, Any] | None = None,
        model_cfg: Any = None,
        init_from: str = "",
        init_skip_head: bool = False,
        early_stopping_patience: int = 0,
        nonfinite: str = "stop",
        rollback_lr_factor: float = 1.0,
        max_rollbacks: int = 0,
        search_trial: SearchTrial | None = None,
        log_every_steps: int = 50,
        grad_clip_norm: float = 0.0,
        precision: str = "fp32",
        deterministic: bool = False,
        profile: ProfileConfig | None = None,
        compile_cache: CompileCache | None = None,
        out_of_memory: str = "stop",
    ) -> None:
        self.dist_info = dist_info
        self.plan = plan
        self.checkpoints = checkpoints
        self.cadence = cadence
        self.open_logger = open_logger
        self.recipe = recipe
        self.run_dir = Path(run_dir)
        self.resume_from_checkpoint = resume_from_checkpoint
        self.eval_every_epochs = eval_every_epochs
        self.model = model
        self.scaler = scaler
        self.sampler = sampler
        self.train_sums = train_sums
        self.extra_state = dict(extra_state or {})
        self.sharded = sharded
        self.milestones = dict(milestones or {})
        self.config = config
        self.model_cfg = model_cfg
        self.init_from = init_from
        self.init_skip_head = init_skip_head
        self.early_stopping_patience = early_stopping_patience
        self.nonfinite = nonfinite
        self.rollback_lr_factor = rollback_lr_factor
        self.max_rollbacks = max_rollbacks
        self.search_trial = search_trial
        self.log_every_steps = log_every_steps
        self.grad_clip_norm = grad_clip_norm
        self.deterministic = deterministic
        self.profile = profile or ProfileConfig()
        self.compile_cache = compile_cache
        self.out_of_memory = out_of_memory
        self.micro_batch = plan.micro_batch  # in use: trainer.batch_size, or less once halved
        self._device_key = device_description(dist_info.device, dist_info.world_size)
        halve = out_of_memory == "halve"
        if halve:
            check_can_halve(model)
        self._step_start = StepStart(model, train_sums, dist_info.device) if halve else None
        self._reduces_gradients = halve and dist_info.distributed and not sharded  # common.pytorch.distributed
        self._in_forward_backward = False  # inside a step, before its gradients are reduced, clipped or applied
        self._redo = False  # the step that was just handed out ran out of memory: hand it out again
        self.watch = NonfiniteWatch(dist_info.device)
        self.telemetry = StepTelemetry(dist_info.device, precision)
        self._progress = Progress()
        # trainer.nonfinite=rollback: a checkpoint to go back to is saved before the next step (a fresh
        # run's step 0; the first step of an optimizer started mid-run, which an older one cannot restore)
        self._save_before_next_step = False
        self.logger: RunLogger | None = None
        self.loaded: LoadedCheckpoint | None = None
        self.provenance: dict[str, Any] | None = None  # this segment's record (rank 0), in every manifest it saves
        self.profiler: StepProfiler | None = None
        self._flop_count: FlopCount | None = None
        self._bar: Any = None
        # A DataLoader over the plan's EpochBatches: the one iterator the epochs share, and where the
        # sampler must be for it to go on (the next epoch's start once an epoch is done; None: start anew).
        self._stream: tuple[Any, Iterator[Any]] | None = None
        self._stream_at: tuple[int, int] | None = None
        self._clock = time.monotonic()  # wall time of this segment, added to progress.train_seconds at each save
        self.optimizer = None
        self.track_optimizer(optimizer, scheduler)

    @classmethod
    def from_config(cls, cfg: RunConfig, dist_info: DistInfo, plan: StepPlan, **objects: Any) -> TrainingRun:
        """From a recipe's whole config: its ``checkpoint`` node (read here only), ``logging``,
        ``profile``, the ``trainer`` settings the class names, ``recipe``, ``run_dir``, ``init_from``
        and ``init_skip_head``. ``objects``: see the class.
        In the ISC's ``CHECKPOINT_ARTIFACT_PATH`` nothing is pruned: the ISC deletes what it does not ship.
        Installs the SIGTERM/SIGUSR1 handlers."""
        checkpoint = cfg.checkpoint
        checkpoints = CheckpointManager(
            checkpoint.dir,
            keep_last=KEEP_ALL if is_artifact_path(checkpoint.dir) else checkpoint.keep_last,
            keep_best=checkpoint.keep_best,
            best_metric=checkpoint.best_metric,
            best_mode=checkpoint.best_mode,
            async_save=checkpoint.async_save,
        )
        cadence = CheckpointCadence(checkpoint.every_steps, checkpoint.every_seconds, checkpoint.sync_every_steps,
                                    StopSignals())
        open_logger = functools.partial(RunLogger.from_config, cfg, dist_info.is_main)
        compile_cache = CompileCache.for_run(cfg.recipe, dist_info.device) if cfg.trainer.compile else None
        return cls(dist_info, plan, checkpoints, cadence, open_logger, recipe=cfg.recipe, run_dir=cfg.run_dir,
                   resume_from_checkpoint=checkpoint.resume, eval_every_epochs=cfg.trainer.eval_every_epochs,
                   config=config_record(cfg), model_cfg=cfg.model,
                   init_from=cfg.init_from,
                   init_skip_head=cfg.init_skip_head, early_stopping_patience=cfg.trainer.early_stopping_patience,
                   nonfinite=cfg.trainer.nonfinite.value, rollback_lr_factor=cfg.trainer.rollback_lr_factor,
                   max_rollbacks=cfg.trainer.max_rollbacks, log_every_steps=cfg.trainer.log_every_steps,
                   grad_clip_norm=cfg.trainer.grad_clip_norm, precision=cfg.trainer.precision.value,
                   deterministic=cfg.trainer.deterministic, profile=cfg.profile, compile_cache=compile_cache,
                   out_of_memory=cfg.trainer.out_of_memory.value, search_trial=SearchTrial.from_environment(),
                   **objects)

    @property
    def progress(self) -> Progress:
        """Where the run is: one object for the whole run, which every restore (a resume, a rollback)
        updates in place, so a loop that holds it always reads the current step and epoch. Read-only:
        assigning another Progress here would leave the loop's copy behind."""
        return self._progress

    # ---- resume ---------------------------------------------------------------------------------

    def resume(self) -> Progress:
        """Restore everything from the newest valid checkpoint (none: start at step 0, from the
        weights of ``init_from`` when it is set), open the logs and return :attr:`progress`, which
        later restores (a rollback) update in place, so the loop may keep it. Loaded to
        the CPU: RNG states must be there, and so must the optimizer's step counts (on a GPU each
        optimizer step would read them back to the host). Collective."""
        sharded_model = None
        if self.resume_from_checkpoint:
            with heartbeat.phase(heartbeat.LOAD):
                self.loaded, sharded_model = self._load_latest()
        initialized = None
        if self.loaded is None:
            self.sampler.set_epoch(0)
            if self.init_from:
                initialized = self._initialize_from(self.init_from)
                self.progress.init_from = self.init_from
        else:
            try:
                self._restore(self.loaded, sharded_model)
            except (ValueError, KeyError, RuntimeError) as error:
                raise UserError(f"the checkpoint {self.loaded.path} does not fit this run's config: "
                                f"{str(error).splitlines()[0]}") from error
        if not self.training_done():
            self.progress.finished = False  # a finished run restarted with more epochs or steps goes on
        self.logger = self.open_logger(self.progress.step)
        if self.loaded is not None:
            self.console(f"resumed from {self.loaded.path} ({self.progress.describe()})")
            self._resume_micro_batch()
            if self.compile_cache is not None:
                self.console(self.compile_cache.restore(self.loaded))
            if self.init_from:
                self.console(f"init_from={self.init_from} ignored: the run resumed from its own checkpoint")
        if initialized is not None:
            self.console(f"initialized from {initialized}")
        self._record_provenance()
        self.profiler = StepProfiler(self.profile, self.run_dir, self.dist_info, self.console)
        self._clock = time.monotonic()
        self.telemetry.start_window()
        self.cadence.saved()  # the wall-clock interval starts now, as after a save
        # A rollback needs a finite checkpoint to go back to, from the first step on. It is saved when
        # the loop asks for its first step: a recipe may hand over its optimizer only after resume()
        # (dinov2_fsdp makes the one of the stage the progress says), and a save needs it.
        self._save_before_next_step = self.nonfinite == "rollback" and self.loaded is None
        return self.progress

    def _resume_micro_batch(self) -> None:
        """Go on with the micro-batch the run had halved to where it was found to fit (the same GPU
        model and memory, the same number of ranks); elsewhere (a larger GPU, say) try
        ``trainer.batch_size`` again."""
        saved, progress = self.progress.micro_batch_size, self.progress
        if not saved or saved >= self.plan.micro_batch:
            return
        if self.out_of_memory == "halve" and progress.micro_batch_found_on == self._device_key:
            self.micro_batch = saved
            self.console(f"micro-batches of {saved} (trainer.batch_size={self.plan.micro_batch} halved after running "
                         f"out of memory on {self._device_key}): each batch is cut in "
                         f"{math.ceil(self.plan.micro_batch / saved)}, the global batch kept")
            return
        self.console(f"trainer.batch_size={self.plan.micro_batch} again: the run had halved it to {saved} on "
                     f"{progress.micro_batch_found_on}, and runs on {self._device_key} now")
        progress.micro_batch_size, progress.micro_batch_found_on = 0, ""

    def _record_provenance(self) -> None:
        """Record this segment (``common/records/provenance.py``; collective). With ``trainer.deterministic``, say
        in a line when the checkpoint it resumes was written with another GPU, driver or software, since
        the continuation cannot then be bit-identical."""
        resumed_from = {"checkpoint": self.loaded.path.name, "step": self.loaded.step} if self.loaded else None
        self.provenance = segment_record(self.run_dir, self.dist_info, resumed_from, self.recipe)
        if self.deterministic and self.loaded is not None and self.provenance is not None:
            differences = bit_identity_differences(self.loaded.provenance, self.provenance)
            if differences:
                self.console(f"trainer.deterministic=true, but this resume will not be bit-identical to an "
                             f"uninterrupted run: {self.loaded.path.name} was written with " + ", ".join(differences))

    def _load_latest(self) -> tuple[LoadedCheckpoint | None, dict[str, Any] | None]:
        """The newest valid checkpoint, loaded to the CPU, and the model's shards read from it
        (sharded models; they are loaded into the model by :meth:`_restore`). Collective."""
        sharded_model = None
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            sharded_model = {"model": get_model_state_dict(self.model)}
        return self.checkpoints.load_latest(map_location="cpu", sharded_state=sharded_model), sharded_model

    def _initialize_from(self, source: str) -> str:
        """Load the weights of ``source`` into the model (and into extra state that is a copy of
        it, such as an EMA, which then starts from the same weights); say what was loaded."""
        from common.after_training.init_from import initialize_model

        description = initialize_model(self.model, self.model_cfg, self.recipe, source, self.init_skip_head,
                                       sharded=self.sharded)
        weights = self.model.state_dict() if not self.sharded else None
        for obj in self.extra_state.values():
            if weights is not None and isinstance(obj, torch.nn.Module) and obj.state_dict().keys() == weights.keys():
                obj.load_state_dict(weights)
        return description

    def _restore(self, loaded: LoadedCheckpoint, sharded_model: dict[str, Any] | None) -> None:
        """Load ``loaded`` into the tracked objects, one resume later. RNG states and partial metric
        sums are restored per rank when the world size is unchanged. On a different world size
        every rank takes rank 0's RNG states (the run continues, but cannot be bit-exact), and rank
        0 takes the metric sums of all saved ranks while the others start from zero, so the totals
        are kept."""
        state = loaded.state
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(self.model, sharded_model["model"])
        else:
            self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            self._restore_optimizer(loaded)
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        for name, obj in self.extra_state.items():
            if name not in state.get("extra", {}):
                raise UserError(f"{loaded.path} holds no {name} state: it was saved by a run without it")
            obj.load_state_dict(state["extra"][name])
        self.sampler.load_state_dict(state["sampler"])
        rank, world_size = self.dist_info.rank, self.dist_info.world_size
        rngs, saved_sums = state["rng"], state["metrics"]
        same_world = len(rngs) == world_size
        if same_world:
            self.train_sums.load_state_dict(saved_sums[rank])
        else:
            self.train_sums.load_state_dict(_merged_sums(saved_sums) if rank == 0 else {})
        set_rng_state(rngs[rank] if same_world else rngs[0])
        self.progress.load_state_dict(state["progress"])
        self.progress.resumes += 1
        heartbeat.at_step(self.progress.step)

    def _restore_optimizer(self, loaded: LoadedCheckpoint) -> None:
        if self.sharded:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

            from common.checkpoint.layout import SHARDED_DIR

            shards = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
            dcp.load(shards, checkpoint_id=str(loaded.path / SHARDED_DIR))
            set_optimizer_state_dict(self.model, self.optimizer, shards["optimizer"])
        else:
            self.optimizer.load_state_dict(loaded.state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(loaded.state["scheduler"])

    def track_optimizer(self, optimizer: torch.optim.Optimizer | None, scheduler: Any, restore: bool = False) -> None:
        """Save ``optimizer`` and ``scheduler`` from now on, in place of the ones tracked so far (its
        steps are marked in the heartbeat). ``restore``: they are the ones the checkpoint resumed
        from was saved with (a recipe that chooses its optimizer by the progress :meth:`resume`
        returned): load their state."""
        if optimizer is not None and optimizer is not self.optimizer:
            optimizer.register_step_pre_hook(self._optimizer_stepping)
        self.optimizer, self.scheduler = optimizer, scheduler
        if restore and self.loaded is not None:
            self._restore_optimizer(self.loaded)
        elif not restore:
            self.progress.flops_per_sample = None  # what a step trains changed: count its FLOPs again
            # A rollback from here on must find a checkpoint of this optimizer (dinov2's fine-tune).
            self._save_before_next_step = self.nonfinite == "rollback" and self.logger is not None

    def _optimizer_stepping(self, *_: Any) -> None:
        """Before an optimizer step: past the step's forward and backward passes (an out-of-memory
        error is no longer retried: the weights may change)."""
        self._in_forward_backward = False
        heartbeat.enter(heartbeat.OPTIMIZER)

    # ---- the loop -------------------------------------------------------------------------------

    def training_done(self) -> bool:
        return (self.progress.epoch >= self.plan.epochs or self.progress.step >= self.plan.total
                or self.progress.stopped_early or self.progress.pruned is not None)

    def steps(self, micro_batches: Iterable[Any]) -> Iterator[MicroBatches]:
        """The optimizer steps left in this epoch, each the :class:`~common.run.steps.MicroBatches` of one
        step (``micro_batches``: the rest of the epoch, as the sampler hands it out: index tensors or
        a DataLoader). After each step (which must call :meth:`step_done`) it saves when the cadence
        says so; after SIGTERM/SIGUSR1 it saves and raises :class:`~common.errors.Preempted`. It
        ends at the epoch's end or at the run's last step. It times how long each micro-batch takes
        to come (``train/data_wait_frac``), counts the FLOPs of the step that needs counting
        (``train/mfu``) and traces the steps ``profile.*`` asks for."""
        plan, progress = self.plan, self.progress
        if self._save_before_next_step:
            self._save_before_next_step = False
            self.save()
        extra = f" ({', '.join(f'{k} {v}' for k, v in progress.extra.items())})" if progress.extra else ""
        self._bar = self.logger.progress(plan.per_epoch, initial=plan.per_epoch - plan.steps_left(),
                                         description=f"epoch {progress.epoch + 1}/{plan.epochs}{extra}")
        try:
            for group in plan.groups(self._epoch_source(micro_batches), keep=self._step_start is not None):
                group.size = self.micro_batch
                step = progress.step
                self.profiler.step_starting(step + 1)
                if progress.flops_per_sample is None and self._flop_count is None:
                    self._flop_count = FlopCount()
                if self._step_start is not None:
                    self._step_start.take()
                    group.on_error = self._out_of_memory
                if self._reduces_gradients:
                    group.after_last = self._reduce_gradients
                self._in_forward_backward = True
                yield group
                while self._redo:
                    self._redo_step(group, step + 1)
                    self._in_forward_backward = True
                    yield group
                self._in_forward_backward = False
                if progress.step != step + 1:
                    raise RuntimeError("the loop must call run.step_done() once after each optimizer step")
                if progress.step >= plan.total:
                    return  # the finish saves the last step
                decision = self.cadence.after_step(progress.step, self.watch.poll, self.micro_batch)
                self._agree_on_micro_batch(decision.micro_batches)
                if decision.nonfinite_step != NONE or decision.save:
                    if not self._finite_or_handled():
                        return  # rolled back: the caller's loop goes on from where the sampler now is
                if decision.save:
                    self.save()
                if decision.stop:
                    self.checkpoints.wait()
                    self.profiler.close()
                    self.logger.close()
                    raise self.cadence.preempted(progress.step)
        finally:
            self._bar.close()
            self._bar = None
            self._stream_at = (self.sampler.epoch + 1, 0) if plan.epoch_done() else None
            if self._flop_count is not None:  # a step that failed: its counter must not stay on in this process
                self._flop_count.stop()
                self._flop_count = None

    def _epoch_source(self, micro_batches: Iterable[Any]) -> Iterator[Any]:
        """This epoch's micro-batches, timed: a new iterator over ``micro_batches`` (index tensors, or
        a DataLoader read an epoch at a time); for a DataLoader over the plan's
        :class:`~common.run.steps.EpochBatches`, the run's one iterator over it, kept from epoch to epoch
        while the sampler is where it left off (a resume or a rollback starts a new one)."""
        if not isinstance(getattr(micro_batches, "batch_sampler", None), EpochBatches):
            return self.telemetry.batches(micro_batches)
        at = (self.sampler.epoch, self.sampler.consumed)
        if self._stream is None or self._stream[0] is not micro_batches or self._stream_at != at:
            self._stream = (micro_batches, self.telemetry.batches(micro_batches))
        return self._stream[1]

    # ---- trainer.out_of_memory=halve (common/run/out_of_memory.py) ----------------------------------

    def _out_of_memory(self, error: BaseException) -> bool:
        """A step's ``with group:`` ended in ``error``: True (swallow it, the step is handed out again
        by :meth:`steps`) for an out-of-memory error in its forward or backward passes while the
        micro-batch can still be halved; a one-line error once it is down to one sample."""
        if not isinstance(error, torch.OutOfMemoryError) or not self._in_forward_backward:
            return False
        self._in_forward_backward = False
        if self.micro_batch == 1:
            raise out_of_memory_error(error, self.run_dir, self.dist_info, self.plan.micro_batch, 0, "halve",
                                      micro_batch=1) from error
        self._redo = True
        return True

    def _redo_step(self, group: MicroBatches, step: int) -> None:
        """Make the step that ran out of memory start again, with half the micro-batch: its
        gradients dropped, the generators, buffers and metric sums as they were when it began (so
        it draws and counts what a run with the smaller micro-batch would), the same samples."""
        self._redo = False
        ranks = [self.dist_info.rank]
        if self.dist_info.distributed and communicates_in_forward(self.model):
            with heartbeat.phase(heartbeat.OUT_OF_MEMORY):  # every rank ran out here too, or the others wait
                where = distributed.all_gather_object((step, self.micro_batch, group.handed_out))
            if len(set(where)) > 1:
                raise UserError(f"the ranks ran out of memory at different points ((step, micro-batch size, "
                                f"micro-batches begun) by rank: {where}), and their model's forward passes make "
                                f"collective calls: they cannot redo the step apart; use a smaller trainer.batch_size",
                                agreed=True)
            ranks = list(range(self.dist_info.world_size))
        drop_gradients(self.model)
        self._step_start.restore()
        if self._flop_count is not None:  # count the step as it is done, not the failed attempt
            self._flop_count.stop()
            self._flop_count = FlopCount()
        gc.collect()  # the failed attempt's activations, held in cycles through its traceback
        if self.dist_info.device.type == "cuda":
            torch.cuda.empty_cache()
        before, self.micro_batch = self.micro_batch, halved(self.micro_batch)
        group.restart(self.micro_batch)
        self._note_halving(step, ranks, self.micro_batch)
        self.console(f"out of memory in step {step} on rank(s) {', '.join(map(str, ranks))} with micro-batches of "
                     f"{before}: the step again with {self.micro_batch} ({len(group)} per step on each rank, the "
                     f"global batch kept)", everywhere=len(ranks) == 1)

    def _note_halving(self, step: int, ranks: list[int], size: int) -> None:
        """Record a halving in :attr:`progress` (merged with the other ranks' where they agree)."""
        record = {"step": step, "ranks": ranks, "micro_batch_size": size, "found_on": self._device_key}
        records = self.progress.out_of_memory
        if not records or (records[-1]["step"], records[-1]["micro_batch_size"]) != (step, size):
            records.append(record)
        self.progress.micro_batch_size, self.progress.micro_batch_found_on = size, self._device_key

    def _agree_on_micro_batch(self, micro_batches: Sequence[int],
                              records: list[list[dict[str, Any]]] | None = None) -> None:
        """Where the ranks agree (on the checkpoint cadence, in every save): when a rank has halved its
        micro-batch alone (its forward and backward passes make no collective call), every rank takes
        the smallest, and the ranks' records of halvings (``records``, or gathered now: collective,
        only then) are merged."""
        if len(set(micro_batches)) <= 1:
            return
        size = min(micro_batches)
        if records is None:
            records = distributed.all_gather_object(self.progress.out_of_memory)
        self.progress.out_of_memory = _merged_halvings(records)
        if size < self.micro_batch:
            self.micro_batch = size
        self.progress.micro_batch_size, self.progress.micro_batch_found_on = size, self._device_key
        self.console(f"every rank now cuts its batches in micro-batches of {size} (rank(s) "
                     f"{', '.join(str(rank) for rank, own in enumerate(micro_batches) if own == size)} ran out of "
                     f"memory)")

    def _reduce_gradients(self) -> None:
        """After a step's last micro-batch: the gradients averaged over the ranks (what DDP does in
        the backward pass, here outside it, so a rank may redo its micro-batches alone)."""
        self._in_forward_backward = False
        all_reduce_gradients(self.model)

    def clip_grad_norm(self, parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor | None:
        """The step's total gradient norm before clipping, with the gradients clipped to
        ``trainer.grad_clip_norm`` when that is set (:func:`common.records.telemetry.clip_grad_norm`; under
        fp16 they are unscaled first). Computed every step when clipping, else only on a step that
        logs (``train/grad_norm``): None on the others, which pay nothing. No host sync. Call it
        between the backward passes and the optimizer step, and hand its value to :meth:`step_done`."""
        self._in_forward_backward = False
        if not self.grad_clip_norm and (self.progress.step + 1) % self.log_every_steps:
            return None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        return clip_grad_norm(parameters, self.grad_clip_norm)

    def step_done(self, samples: int, grad_norm: torch.Tensor | None = None, *, loss: torch.Tensor | None) -> None:
        """Count an optimizer step that used ``samples`` samples on each rank (the sampler's position
        moves on by that many for every rank), and watch it for values that are not finite.

        - ``loss``: the training loss the divergence watch reads, on the device (no host sync): the
          recipes hand it the running sum of every micro-batch's loss, ``train_sums.running("loss")``.
          None (a sum under another name) stops the run with one line, never an unwatched run.
        - ``grad_norm``: watched where the step clips (:meth:`clip_grad_norm`); a norm measured only
          for the log is not, so that a divergence is still told on the ranks where the loss went
          first. Under fp16 a non-finite gradient is the grad scaler's to handle (it skips that step
          and lowers its scale), so it is not watched there."""
        if loss is None:
            raise UserError("run.step_done() got loss=None: hand it the step's training loss on the device "
                            "(train_sums.running(<the name the loop sums its loss under>)), which trainer.nonfinite "
                            "watches")
        self.sampler.advance(samples)
        self.progress.step += 1
        heartbeat.at_step(self.progress.step)
        heartbeat.enter(heartbeat.AFTER_STEP)
        scaler_skips = self.scaler is not None and self.scaler.is_enabled()
        watched_norm = grad_norm if self.grad_clip_norm and not scaler_skips else None
        self.watch.observe(self.progress.step, loss, watched_norm)
        self.telemetry.step_done(samples, grad_norm)
        if self._flop_count is not None:
            self.progress.flops_per_sample = self._flop_count.stop() / max(samples, 1)
            self._flop_count = None
        self.profiler.step_finished(self.progress.step)
        self._bar.update()

    def log_train(self, metrics: dict[str, float]) -> None:
        """Log training metrics at this step with the run's telemetry since the previous log
        (``common/records/telemetry.py``: ``train/images_per_s``, ``train/step_s``, ``train/data_wait_frac``,
        ``train/grad_norm``, ``train/max_mem_gib``, ``train/mfu``, the slowest rank); show them on the
        progress bar, or as a progress line where there is no terminal. Collective on several ranks."""
        metrics = {**metrics, **self.telemetry.report(self.dist_info.world_size, self.progress.flops_per_sample,
                                                      self.cadence.group)}
        if self.out_of_memory == "halve":
            metrics["train/micro_batch_size"] = float(self.micro_batch)
        self.logger.log(metrics, self.progress.step)
        if self._bar is not None:
            self._bar.set_postfix({name.removeprefix("train/"): f"{value:.4g}" for name, value in metrics.items()})

    def log_eval(self, metrics: dict[str, float], headline: list[str] | None = None) -> dict[str, float]:
        """Log evaluation metrics at this step and print them (or the ``headline`` ones) in a line."""
        self.logger.log(metrics, self.progress.step)
        shown = metrics if headline is None else {name: metrics[name] for name in headline}
        self.console(f"{self.progress.describe()}: "
                     + ", ".join(f"{name} {value:.4f}" for name, value in shown.items()))
        return metrics

    def console(self, message: str, everywhere: bool = False) -> None:
        """A line on stdout, from rank 0 (``everywhere``: from this rank, whichever it is, naming it)."""
        if everywhere and not self.dist_info.is_main:
            print(f"rank {self.dist_info.rank}: {message}", flush=True)
        else:
            self.logger.console(message)

    def end_epoch(self, evaluate: Callable[[], dict[str, float]]) -> None:
        """After :meth:`steps`: if the epoch is complete (not cut short by ``trainer.max_steps``),
        the next one starts; unless training is done then (the finish evaluates and saves), the
        checkpoint of the epoch's end is saved, with ``evaluate()``'s metrics every
        ``trainer.eval_every_epochs`` epochs. An evaluation that makes early stopping's patience run
        out, or that a search prunes, ends training instead (the finish then evaluates and saves). It
        first checks that training is still finite, as before every save; a rollback leaves the epoch
        unfinished."""
        if not self._finite_or_handled() or not self.plan.epoch_done():
            return
        self.progress.epoch += 1
        self.sampler.set_epoch(self.progress.epoch)
        if self.training_done():
            return
        metrics = self._evaluate(evaluate) if self.progress.epoch % self.eval_every_epochs == 0 else None
        if metrics is not None:
            self._count_improvement(metrics, may_stop=True)
            self._report_to_search(metrics)
        if not self.training_done():
            self.save(metrics, milestone=self.milestones.get(self.progress.epoch))

    def _evaluate(self, evaluate: Callable[[], dict[str, float]]) -> dict[str, float]:
        """``evaluate()``, marked in the heartbeat and left out of the step time."""
        with heartbeat.phase(heartbeat.EVALUATION), self.telemetry.excluded():
            return evaluate()

    def _count_improvement(self, metrics: dict[str, float], may_stop: bool) -> None:
        """Early stopping: count this evaluation as one without improvement unless it beats the
        best ``checkpoint.best_metric`` so far (NaN never does); stop when ``may_stop`` and the
        count reaches ``trainer.early_stopping_patience``. The same on every rank (reduced metrics)."""
        if self.early_stopping_patience <= 0:
            return
        name, mode, progress = self.checkpoints.best_metric, self.checkpoints.best_mode, self.progress
        if name not in metrics:
            raise UserError(f"trainer.early_stopping_patience watches checkpoint.best_metric={name}, which the "
                            f"evaluation does not report; it reports {', '.join(sorted(metrics))}")
        value = metrics[name]
        if improves(value, progress.best_value, mode):
            progress.best_value, progress.evals_without_improvement = value, 0
        else:
            progress.evals_without_improvement += 1
        if may_stop and progress.evals_without_improvement >= self.early_stopping_patience:
            progress.stopped_early = True
            best_text = "no value" if progress.best_value is None else f"{progress.best_value:.4g}"
            self.console(f"early stopping: {name} has not improved on {best_text} for "
                         f"{progress.evals_without_improvement} evaluation(s); stopping after epoch {progress.epoch} "
                         f"(step {progress.step})")

    # ---- a trial of a hyperparameter search (common/run/search_trial.py) ----------------------------

    def _report_to_search(self, metrics: dict[str, float]) -> None:
        """Report this evaluation to the search this run is a trial of, if any; when its pruner says
        so, training ends here (collective: the ranks agree on the study's answer)."""
        if self.search_trial is None:
            return
        if self.search_trial.report(metrics, self.progress.epoch, self.dist_info.is_main):
            metric = self.search_trial.metric
            self.progress.pruned = {"step": self.progress.step, "epoch": self.progress.epoch, "metric": metric,
                                    "value": metrics[metric]}
            self.console(f"pruned by the search at step {self.progress.step} (epoch {self.progress.epoch}): "
                         f"{metric} {metrics[metric]:.4g}; stopping here")

    # ---- non-finite training: stop, or roll back (trainer.nonfinite) ----------------------------

    def _finite_or_handled(self) -> bool:
        """Check exactly that training is finite so far on every rank: the watched values, and the
        state a checkpoint would hold (an update can make the weights non-finite before any loss
        shows it). Collective; it waits for the device, as the save it precedes does. True when
        finite. Otherwise, with ``trainer.nonfinite=rollback`` and rollbacks left, go back to the
        last finite checkpoint and return False; else stop the run (:class:`Diverged`)."""
        with heartbeat.phase(heartbeat.FINITE_CHECK):
            seen = distributed.all_gather_object((self.watch.settle(), self._state_finite()))
        watched = {rank: step for rank, (step, _) in enumerate(seen) if step != NONE}
        if watched:  # where a loss or gradient went non-finite first, not the weights that followed
            nonfinite_step = min(watched.values())
            ranks = sorted(rank for rank, step in watched.items() if step == nonfinite_step)
        else:
            nonfinite_step, ranks = self.progress.step, [rank for rank, (_, finite) in enumerate(seen) if not finite]
        if not ranks:
            return True
        hosts = distributed.all_gather_object(socket.gethostname())
        what = (f"the training was not finite at step {nonfinite_step} on "
                + ", ".join(f"rank {rank} ({hosts[rank]})" for rank in ranks))
        if self.nonfinite == "rollback" and len(self.progress.rollbacks) < self.max_rollbacks:
            if self._roll_back(nonfinite_step, ranks, what):
                return False
        self._stop_diverged(nonfinite_step, ranks, [hosts[rank] for rank in ranks], what)

    def _state_finite(self) -> bool:
        states: list[Any] = [self.model.state_dict(), *(obj.state_dict() for obj in self.extra_state.values())]
        if self.optimizer is not None:
            states.append(list(self.optimizer.state.values()))
        return all_finite(*states)

    def _roll_back(self, nonfinite_step: int, ranks: list[int], what: str) -> bool:
        """Back to the newest valid checkpoint (all of it: weights, optimizer, schedule, sampler,
        RNGs), past the micro-batches of the steps up to ``nonfinite_step`` (a bit-exact
        continuation would meet them again), with the LR times ``trainer.rollback_lr_factor``;
        checkpointed at once, so a restart keeps all three. False when there is no checkpoint."""
        detected_at, kept = self.progress.step, replace(self.progress)  # the restore overwrites the counters
        seconds = kept.train_seconds + time.monotonic() - self._clock
        self.checkpoints.wait()
        with heartbeat.phase(heartbeat.LOAD):
            loaded, sharded_model = self._load_latest()
        if loaded is None:
            return False
        self.loaded = loaded
        self._restore(loaded, sharded_model)
        self._stream = None  # the loader's iterator is past the batches the restored sampler hands out next
        back_to = self.progress.step
        self.plan.skip(nonfinite_step - back_to)
        scale_learning_rate(self.optimizer, self.scheduler, self.rollback_lr_factor)
        record = {"nonfinite_step": nonfinite_step, "ranks": ranks, "detected_at_step": detected_at,
                  "back_to_step": back_to, "checkpoint": loaded.path.name, "skipped_steps": nonfinite_step - back_to,
                  "lr_factor": self.rollback_lr_factor}
        self.progress.rollbacks = [*kept.rollbacks, record]
        self.progress.out_of_memory = kept.out_of_memory  # the micro-batch in use stays: it is what fits here
        self.progress.micro_batch_size, self.progress.micro_batch_found_on = (kept.micro_batch_size,
                                                                              kept.micro_batch_found_on)
        self.progress.resumes, self.progress.train_seconds = kept.resumes, seconds
        self._clock = time.monotonic()
        self.telemetry.start_window()
        self.watch.reset()
        self.console(f"rollback {len(self.progress.rollbacks)} of at most {self.max_rollbacks}: {what}; back to step "
                     f"{back_to} ({loaded.path.name}), skipping the batches of steps {back_to + 1}-{nonfinite_step}"
                     + (f", lr x{self.rollback_lr_factor:g}" if self.rollback_lr_factor != 1.0 else ""))
        self.save()
        return True

    def _stop_diverged(self, nonfinite_step: int, ranks: list[int], hosts: list[str], what: str) -> None:
        """Stop every rank: the newest checkpoint (never a non-finite one) stays the latest, the
        summary says where the run diverged, and the run ends with :data:`~common.errors.EXIT_DIVERGED`."""
        self.progress.train_seconds += time.monotonic() - self._clock
        self.checkpoints.wait()
        last = distributed.broadcast_object(latest_checkpoint(self.checkpoints.directory)
                                            if self.dist_info.is_main else None)
        if last is None:
            kept = "no checkpoint was written before it"
        else:
            kept = f"the last finite checkpoint, {last.path} (step {last.step}), stays the latest"
        rollbacks = self.progress.rollbacks
        after = f" after {len(rollbacks)} rollback(s)" if rollbacks else ""
        message = (f"the run diverged{after}: {what}; {kept}. Lower optim.lr"
                   + ("" if self.nonfinite == "rollback" else " or let it roll back (trainer.nonfinite=rollback)")
                   + f"; exiting with code {EXIT_DIVERGED}")
        if self.dist_info.is_main:
            diverged = {"step": nonfinite_step, "ranks": ranks, "hosts": hosts,
                        "checkpoint": last.path.name if last is not None else None}
            write_summary(self.run_dir, recipe=self.recipe, metrics=last.metrics if last is not None else {},
                          progress=self.progress, world_size=self.dist_info.world_size, model_digest=None,
                          diverged=diverged, **({"rollbacks": rollbacks} if rollbacks else {}))
        self.logger.close()
        self.cadence.close()
        raise Diverged(message, agreed=True)

    # ---- checkpoints ----------------------------------------------------------------------------

    def save(self, metrics: dict[str, float] | None = None, milestone: str | None = None) -> None:
        """Checkpoint everything now (collective: every rank calls it), with this segment's provenance."""
        with heartbeat.phase(heartbeat.SAVE):
            self._save(metrics, milestone)

    def _save(self, metrics: dict[str, float] | None, milestone: str | None) -> None:
        now = time.monotonic()
        self.progress.train_seconds += now - self._clock
        self._clock = now
        with self.telemetry.excluded():
            sharded_state = None
            if self.sharded:
                from torch.distributed.checkpoint.state_dict import get_state_dict

                model_shards, optimizer_shards = get_state_dict(self.model, self.optimizer)
                sharded_state = {"model": model_shards, "optimizer": optimizer_shards}
            compiled = self.compile_cache.attachment() if self.compile_cache is not None and self.dist_info.is_main\
                else None
            self.checkpoints.save(self.progress.step, self._capture(), metrics, sharded_state=sharded_state,
                                  milestone=milestone, config=self.config, provenance=self.provenance,
                                  attachments=(compiled,) if compiled else ())
        self.cadence.saved()

    def _capture(self) -> dict[str, Any]:
        """The checkpoint's ``state.pt``. Collective: each rank's RNG states and partial metric sums
        are gathered, since only rank 0 writes it."""
        per_rank = distributed.all_gather_object({"rng": rng_state(), "metrics": self.train_sums.state_dict(),
                                                  "micro_batch": self.micro_batch,
                                                  "out_of_memory": self.progress.out_of_memory})
        self._agree_on_micro_batch([own["micro_batch"] for own in per_rank], [own["out_of_memory"] for own in per_rank])
        state: dict[str, Any] = {
            "progress": asdict(self.progress),
            "rng": [own["rng"] for own in per_rank],
            "metrics": [own["metrics"] for own in per_rank],
            "sampler": self.sampler.state_dict(),
        }
        if not self.sharded:
            state["model"] = self.model.state_dict()
            state["optimizer"] = self.optimizer.state_dict()
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        if self.extra_state:
            state["extra"] = {name: obj.state_dict() for name, obj in self.extra_state.items()}
        return state

    # ---- the finish -----------------------------------------------------------------------------

    def finish(self, evaluate: Callable[[], dict[str, float]], **summary: Any) -> dict[str, float]:
        """Evaluate, save the final checkpoint and write ``summary.json`` (with ``summary``'s
        entries); a run that was already finished only rewrites its summary. Returns the final
        metrics."""
        if self.progress.finished:
            metrics = self.loaded.metrics
        else:
            metrics = self._evaluate(evaluate)
            if not self.progress.stopped_early:
                self._count_improvement(metrics, may_stop=False)
            self.progress.finished = True
            at_epoch_end = self.sampler.consumed == 0
            self.save(metrics, milestone=self.milestones.get(self.progress.epoch) if at_epoch_end else None)
        self.checkpoints.wait()
        self._stream = None  # the training loader's workers stop
        self.profiler.close()
        self.logger.close()
        self.cadence.close()
        model_digest = self._model_digest()
        if self.dist_info.is_main:
            best = self.checkpoints.best()
            for name, obj in self.extra_state.items():
                summary[f"{name}_digest"] = state_digest(obj.state_dict())
            if self.progress.init_from:
                summary["init_from"] = self.progress.init_from
            if self.progress.rollbacks:
                summary["rollbacks"] = self.progress.rollbacks
            summary["micro_batch_size"] = self.micro_batch
            if self.progress.out_of_memory:
                summary["out_of_memory"] = self.progress.out_of_memory
            if self.early_stopping_patience > 0:
                summary["early_stopping"] = self._early_stopping_summary()
            if self.progress.pruned is not None:
                summary["pruned"] = self.progress.pruned
            path = write_summary(self.run_dir, recipe=self.recipe, metrics=metrics, progress=self.progress,
                                 world_size=self.dist_info.world_size, model_digest=model_digest,
                                 best_checkpoint=best.path.name if best is not None else None,
                                 best_metric=self.checkpoints.best_metric, **summary)
            best_metric = self.checkpoints.best_metric
            headline = f"{best_metric} {metrics[best_metric]:.4f} " if best_metric in metrics else ""
            self.console(f"done: {headline}after {self.progress.step} steps\n"
                         + output_lines(path, self.checkpoints.directory, best.path if best is not None else None,
                                        best_metric, self.logger.log_dir))
        return metrics

    def _early_stopping_summary(self) -> dict[str, Any]:
        progress = self.progress
        return {"patience": self.early_stopping_patience, "metric": self.checkpoints.best_metric,
                "mode": self.checkpoints.best_mode, "best_value": progress.best_value,
                "evaluations_without_improvement": progress.evals_without_improvement,
                "stopped_early": progress.stopped_early,
                "stopped_at_epoch": progress.epoch if progress.stopped_early else None,
                "stopped_at_step": progress.step if progress.stopped_early else None}

    def _model_digest(self) -> str | None:
        """The summary's ``model_digest`` (on rank 0; collective for a sharded model)."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            return state_digest(full) if self.dist_info.is_main else None
        return state_digest(self.model.state_dict()) if self.dist_info.is_main else None
