"""The run contract every recipe's loop follows: resume, checkpoints, pre-emption, the finish.

A recipe hands :class:`TrainingRun` its config and what a checkpoint holds, and keeps its own loop::

    run = TrainingRun(cfg, dist_info, plan, model=model, optimizer=optimizer, ...)
    progress = run.resume()                          # the newest valid checkpoint, if any
    while not run.training_done():
        for group in run.steps(micro_batches):       # one optimizer step per group of micro-batches
            ...forward, backward, optimizer step...
            run.step_done(group.samples, grad_norm, loss=train_sums.running("loss"))
        run.end_epoch(evaluate)                      # evaluates (when due) and saves; also mid-epoch
    run.finish(evaluate)                             # final evaluation, checkpoint, summary.json

- Its parts: :mod:`~common.run.cadence` (when to save and stop), :mod:`~common.run.divergence`
  (``trainer.nonfinite``), :mod:`~common.run.early_stopping`, :mod:`~common.run.out_of_memory`
  (``trainer.out_of_memory``), :mod:`~common.run.search_trial`, :mod:`~common.run.compile_cache`.
- What a resume restores, signals and exit codes: docs/run-contract.md.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from common.after_training.distill import Teacher, check_resumed
from common.checkpoint.layout import is_artifact_path
from common.checkpoint.manager import KEEP_ALL, CheckpointManager, LoadedCheckpoint
from common.config import config_record
from common.data.loaders import copied_ahead
from common.data.sampler import ResumableDistributedSampler
from common.errors import UserError
from common.pytorch.distributed import DistInfo
from common.pytorch.metrics import SumMetrics
from common.records import heartbeat, startup
from common.records.loggers import RunLogger
from common.records.profiling import StepProfiler
from common.records.provenance import bit_identity_differences, segment_record
from common.records.summary import output_lines, state_digest, write_summary
from common.records.telemetry import FlopCount, StepTelemetry, clip_grad_norm
from common.run import state
from common.run.cadence import NONE, CheckpointCadence, EvaluationCadence, StopSignals
from common.run.compile_cache import CompileCache
from common.run.divergence import Divergence
from common.run.early_stopping import EarlyStopping
from common.run.out_of_memory import MicroBatchHalving
from common.run.progress import Progress
from common.run.search_trial import SearchTrial
from common.run.steps import EpochBatches, MicroBatches, StepPlan


class TrainingRun:
    """One run's contract, built once from the recipe's config and the objects a checkpoint holds.

    - ``cfg``: the recipe's whole config, its nodes read whole where they are used: ``trainer``,
      ``checkpoint``, ``logging``, ``profile``, ``model`` (how ``init_from`` names tensors) and
      ``recipe``, ``run_dir``, ``init_from``, ``init_skip_head``; written into every manifest.
    - ``model``: the plain module, not its DDP or ``torch.compile`` wrapper.
    - ``sampler``, ``train_sums``, ``optimizer``, ``scheduler``, ``scaler``: the step's state a
      checkpoint holds; a fresh optimizer mid-run (dinov2's stage switch): :meth:`track_optimizer`.
    - ``extra_state``: more objects with ``state_dict`` (an EMA), checkpointed; ``<name>_digest`` in the summary.
    - ``teacher``: ``distill.teacher``'s model (:func:`~common.after_training.distill.load_teacher`), not
      checkpointed: its source and digest are recorded when the run begins and checked when it resumes.
    - ``sharded``: model and optimizer through ``torch.distributed.checkpoint`` (FSDP2; resumes on
      another number of ranks).
    - ``milestones``: epoch -> reason; the checkpoint of that epoch's end is kept for good (``_force``).
    - Installs the SIGTERM/SIGUSR1 handlers; in the ISC's ``CHECKPOINT_ARTIFACT_PATH`` nothing is pruned.
    - Raises :class:`~common.errors.UserError` for settings it cannot honour (``out_of_memory=halve``).
    """

    def __init__(self, cfg: Any, dist_info: DistInfo, plan: StepPlan, *, model: torch.nn.Module,
                 sampler: ResumableDistributedSampler, train_sums: SumMetrics,
                 optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
                 scaler: torch.amp.GradScaler | None = None, extra_state: dict[str, Any] | None = None,
                 sharded: bool = False, milestones: dict[int, str] | None = None,
                 teacher: Teacher | None = None) -> None:
        checkpoint = cfg.checkpoint
        self.checkpoints = CheckpointManager(
            checkpoint.dir,
            keep_last=KEEP_ALL if is_artifact_path(checkpoint.dir) else checkpoint.keep_last,
            keep_best=checkpoint.keep_best,
            keep_best_k=checkpoint.keep_best_k,
            best_metric=checkpoint.best_metric,
            best_mode=checkpoint.best_mode,
            async_save=checkpoint.async_save,
        )
        self.evaluations = EvaluationCadence(cfg.trainer)
        self.cadence = CheckpointCadence(checkpoint, StopSignals())
        self.cfg, self.trainer, self.dist_info, self.plan = cfg, cfg.trainer, dist_info, plan
        self.recipe, self.run_dir = cfg.recipe, Path(cfg.run_dir)
        self.config = config_record(cfg)
        self.compile_cache = CompileCache.for_run(cfg.recipe, dist_info.device) if self.trainer.compile else None
        self.search_trial = SearchTrial.from_environment()
        self.model, self.sampler, self.train_sums, self.scaler = model, sampler, train_sums, scaler
        self.extra_state = dict(extra_state or {})
        self.teacher = teacher
        self.sharded = sharded
        self.milestones = dict(milestones or {})
        self._progress = Progress()
        self.early_stopping = EarlyStopping(self.trainer.early_stopping_patience, self.checkpoints.best_metric,
                                            self.checkpoints.best_mode)
        self.out_of_memory = MicroBatchHalving(self.trainer, plan.micro_batch, model, train_sums, dist_info,
                                               self._progress, self.console, self.run_dir, sharded)
        self.divergence = Divergence(self.trainer, self)
        self.telemetry = StepTelemetry(dist_info.device, self.trainer.precision.value)
        # trainer.nonfinite=rollback: a checkpoint to go back to is saved before the next step (a fresh
        # run's step 0; the first step of an optimizer started mid-run, which an older one cannot restore)
        self._save_before_next_step = False
        self.logger: RunLogger | None = None
        self.loaded: LoadedCheckpoint | None = None
        self.provenance: dict[str, Any] | None = None  # this segment's record (rank 0), in every manifest it saves
        self.profiler: StepProfiler | None = None
        self._flop_count: FlopCount | None = None
        self.startup = startup.claim()  # this segment's start-up, timed until its first step is done
        self._starting = True  # no step done yet in this segment
        self._startup_logged = False  # in the segment's first training log
        self._bar: Any = None
        # A DataLoader over the plan's EpochBatches: the one iterator the epochs share, and where the
        # sampler must be for it to go on (the next epoch's start once an epoch is done; None: start anew).
        self._stream: tuple[Any, Iterator[Any]] | None = None
        self._stream_at: tuple[int, int] | None = None
        # steps() ended mid-epoch for a trainer.eval_every_steps evaluation, which end_epoch() runs and saves
        self._mid_epoch_evaluation = False
        self._clock = time.monotonic()  # wall time of this segment, added to progress.train_seconds at each save
        self.optimizer = None
        self.track_optimizer(optimizer, scheduler)

    @property
    def progress(self) -> Progress:
        """Where the run is: one object, updated in place by every restore (a resume, a rollback)."""
        return self._progress

    @property
    def micro_batch(self) -> int:
        """The micro-batch in use: ``trainer.batch_size``, or less once halved (``trainer.out_of_memory``)."""
        return self.out_of_memory.micro_batch

    def segment_seconds(self) -> float:
        """Wall time since the segment's clock last started (a save or a restore)."""
        return time.monotonic() - self._clock

    def restart_clock(self) -> None:
        self._clock = time.monotonic()

    # ---- resume ---------------------------------------------------------------------------------

    def resume(self) -> Progress:
        """Restore everything from the newest valid checkpoint and open the logs. Collective.

        - No checkpoint (or ``checkpoint.resume=false``): step 0, from ``init_from``'s weights if set.
        - Loaded to the CPU (RNG states must be there, and the optimizer's step counts are best there).
        - Returns :attr:`progress`, which later restores update in place: the loop may keep it.
        - Raises :class:`~common.errors.UserError` when the checkpoint does not fit the config.
        """
        sharded_model = None
        if self.cfg.checkpoint.resume:
            with heartbeat.phase(heartbeat.LOAD):
                self.loaded, sharded_model = state.load_latest(self)
        initialized = None
        init_from = self.cfg.init_from
        if self.loaded is None:
            self.sampler.set_epoch(0)
            self.progress.teacher = self.teacher.record() if self.teacher is not None else {}
            if init_from:
                initialized = self._initialize_from(init_from)
                self.progress.init_from = init_from
        else:
            try:
                state.restore(self, self.loaded, sharded_model)
            except (ValueError, KeyError, RuntimeError) as error:
                raise UserError(f"the checkpoint {self.loaded.path} does not fit this run's config: "
                                f"{str(error).splitlines()[0]}") from error
            check_resumed(self.progress.teacher, self.teacher)
        if not self.training_done():
            self.progress.finished = False  # a finished run restarted with more epochs or steps goes on
        self.logger = RunLogger.from_config(self.cfg, self.dist_info.is_main, self.progress.step)
        if self.loaded is not None:
            self.console(f"resumed from {self.loaded.path} ({self.progress.describe()})")
            self.out_of_memory.resume()
            if self.compile_cache is not None:
                self.console(self.compile_cache.restore(self.loaded))
            if init_from:
                self.console(f"init_from={init_from} ignored: the run resumed from its own checkpoint")
        if initialized is not None:
            self.console(f"initialized from {initialized}")
        if self.teacher is not None:
            self.console(f"distilling from {self.teacher.description}")
        self._record_provenance()
        self.profiler = StepProfiler(self.cfg.profile, self.run_dir, self.dist_info, self.console)
        self._clock = time.monotonic()
        self.telemetry.start_window()
        self.cadence.saved()  # the wall-clock interval starts now, as after a save
        # A rollback needs a finite checkpoint to go back to, from the first step on. It is saved when
        # the loop asks for its first step: a recipe may hand over its optimizer only after resume()
        # (dinov2_fsdp makes the one of the stage the progress says), and a save needs it.
        self._save_before_next_step = self.divergence.rolls_back and self.loaded is None
        startup.done(startup.RESUME)
        return self.progress

    def reload_latest(self) -> LoadedCheckpoint | None:
        """Load the newest valid checkpoint into everything tracked (a rollback); None when there is none."""
        self.checkpoints.wait()
        with heartbeat.phase(heartbeat.LOAD):
            loaded, sharded_model = state.load_latest(self)
        if loaded is None:
            return None
        self.loaded = loaded
        state.restore(self, loaded, sharded_model)
        self._stream = None  # the loader's iterator is past the batches the restored sampler hands out next
        return loaded

    def _record_provenance(self) -> None:
        """Record this segment (``common/records/provenance.py``; collective); with ``trainer.deterministic``,
        say when the checkpoint resumed was written with another GPU, driver or software."""
        resumed_from = {"checkpoint": self.loaded.path.name, "step": self.loaded.step} if self.loaded else None
        self.provenance = segment_record(self.run_dir, self.dist_info, resumed_from, self.recipe)
        if self.trainer.deterministic and self.loaded is not None and self.provenance is not None:
            differences = bit_identity_differences(self.loaded.provenance, self.provenance)
            if differences:
                self.console(f"trainer.deterministic=true, but this resume will not be bit-identical to an "
                             f"uninterrupted run: {self.loaded.path.name} was written with " + ", ".join(differences))

    def _initialize_from(self, source: str) -> str:
        """Load ``source``'s weights into the model (and into extra state that copies it, an EMA); say what."""
        from common.after_training.init_from import initialize_model

        description = initialize_model(self.model, self.cfg.model, self.recipe, source, self.cfg.init_skip_head,
                                       sharded=self.sharded)
        weights = self.model.state_dict() if not self.sharded else None
        for obj in self.extra_state.values():
            if weights is not None and isinstance(obj, torch.nn.Module) and obj.state_dict().keys() == weights.keys():
                obj.load_state_dict(weights)
        return description

    def track_optimizer(self, optimizer: torch.optim.Optimizer | None, scheduler: Any, restore: bool = False) -> None:
        """Save ``optimizer`` and ``scheduler`` from now on, in place of the ones tracked so far.

        - ``restore``: they are the ones the resumed checkpoint was saved with: load their state.
        - Otherwise a fresh optimizer: its FLOPs are counted again, and with ``trainer.nonfinite=rollback``
          a checkpoint of it is saved before its first step.
        """
        if optimizer is not None and optimizer is not self.optimizer:
            optimizer.register_step_pre_hook(self._optimizer_stepping)
        self.optimizer, self.scheduler = optimizer, scheduler
        if restore and self.loaded is not None:
            state.restore_optimizer(self, self.loaded)
        elif not restore:
            self.progress.flops_per_sample = None  # what a step trains changed: count its FLOPs again
            # A rollback from here on must find a checkpoint of this optimizer (dinov2's fine-tune).
            self._save_before_next_step = self.divergence.rolls_back and self.logger is not None

    def _optimizer_stepping(self, *_: Any) -> None:
        """Before an optimizer step: past the forward and backward passes (no out-of-memory retry now)."""
        self.out_of_memory.past_forward_backward()
        heartbeat.enter(heartbeat.OPTIMIZER)

    # ---- the loop -------------------------------------------------------------------------------

    def training_done(self) -> bool:
        return (self.progress.epoch >= self.plan.epochs or self.progress.step >= self.plan.total
                or self.progress.stopped_early or self.progress.pruned is not None)

    def steps(self, micro_batches: Iterable[Any], to_device: Callable[[Any], Any] | None = None
              ) -> Iterator[MicroBatches]:
        """The optimizer steps left in this epoch, each the :class:`~common.run.steps.MicroBatches` of one step.

        - ``micro_batches``: the rest of the epoch as the sampler hands it out (index tensors, a DataLoader).
        - ``to_device``: starts a batch's copy to the device (``DeviceTrainInput.to_device``); run one
          batch ahead, so on a GPU the copy overlaps the step before (:func:`~common.data.loaders.copied_ahead`).
        - The loop must call :meth:`step_done` once per step; after it this saves when the cadence
          says so, and after SIGTERM/SIGUSR1 saves and raises :class:`~common.errors.Preempted`.
        - Ends at the epoch's end, at the run's last step, after a rollback, or mid-epoch where
          ``trainer.eval_every_steps`` says (the loop's :meth:`end_epoch` evaluates; the next call goes on).
          A stop signal at such a step saves and stops at once; the resumed run evaluates there first.
        - Also: ``train/data_wait_frac`` timing, FLOP counting (``train/mfu``), ``profile.*`` traces.
        """
        plan, progress, halving = self.plan, self.progress, self.out_of_memory
        if progress.evaluation_owed:  # stopped at an evaluation's step before evaluating: end_epoch() evaluates
            progress.evaluation_owed, self._mid_epoch_evaluation = False, True
            return
        if self._save_before_next_step:
            self._save_before_next_step = False
            self.save()
        extra = f" ({', '.join(f'{k} {v}' for k, v in progress.extra.items())})" if progress.extra else ""
        self._bar = self.logger.progress(plan.per_epoch, initial=plan.per_epoch - plan.steps_left(),
                                         description=f"epoch {progress.epoch + 1}/{plan.epochs}{extra}")
        try:
            for group in plan.groups(self._epoch_source(micro_batches, to_device), keep=halving.halves):
                step = progress.step
                self.profiler.step_starting(step + 1)
                if progress.flops_per_sample is None and self._flop_count is None:
                    self._flop_count = FlopCount()
                halving.step_starting(group)
                yield group
                while halving.redo:
                    halving.redo_step(group, step + 1)
                    if self._flop_count is not None:  # count the step as it is done, not the failed attempt
                        self._flop_count.stop()
                        self._flop_count = FlopCount()
                    yield group
                halving.past_forward_backward()
                if progress.step != step + 1:
                    raise RuntimeError("the loop must call run.step_done() once after each optimizer step")
                if progress.step >= plan.total:
                    return  # the finish saves the last step
                decision = self.cadence.after_step(progress.step, self.divergence.poll, self.micro_batch)
                halving.agree(decision.micro_batches)
                evaluating = self.evaluations.mid_epoch(progress.step) and not plan.epoch_done()
                if decision.nonfinite_step != NONE or decision.save or evaluating:
                    if not self.divergence.check():
                        return  # rolled back: the caller's loop goes on from where the sampler now is
                if evaluating and decision.stop:  # a stop is quick: the checkpoint owes the evaluation to the resume
                    progress.evaluation_owed = True
                elif evaluating:  # the loop's end_epoch() evaluates and saves
                    self._mid_epoch_evaluation = True
                    return
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
            if plan.epoch_done():
                self._stream_at = (self.sampler.epoch + 1, 0)
            else:  # after a mid-epoch evaluation the loader's iterator goes on; otherwise a new one starts
                self._stream_at = (self.sampler.epoch, self.sampler.consumed) if self._mid_epoch_evaluation else None
            if self._flop_count is not None:  # a step that failed: its counter must not stay on in this process
                self._flop_count.stop()
                self._flop_count = None

    def _epoch_source(self, micro_batches: Iterable[Any], to_device: Callable[[Any], Any] | None) -> Iterator[Any]:
        """This epoch's micro-batches, timed, copied to the device one ahead (``to_device``). A
        DataLoader over the plan's :class:`~common.run.steps.EpochBatches` keeps one iterator from
        epoch to epoch while the sampler is where it left off (a resume or a rollback starts a new one)."""
        if isinstance(getattr(micro_batches, "batch_sampler", None), EpochBatches):
            at = (self.sampler.epoch, self.sampler.consumed)
            if self._stream is None or self._stream[0] is not micro_batches or self._stream_at != at:
                self._stream = (micro_batches, self._batches(micro_batches, to_device))
            return self._stream[1]
        return self._batches(micro_batches, to_device)

    def _batches(self, micro_batches: Iterable[Any], to_device: Callable[[Any], Any] | None) -> Iterator[Any]:
        batches = iter(micro_batches)  # made now: a DataLoader seeds its workers from the global generator
        if to_device is not None:
            batches = copied_ahead(batches, to_device, self.dist_info.device)
        return self.telemetry.batches(batches)

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Work in a step that is not the model's own (a distillation teacher's forward): left out of the
        FLOPs behind ``train/mfu``, still inside the step's time (``train/step_s``)."""
        if self._flop_count is None:
            yield
        else:
            with self._flop_count.excluded():
                yield

    def clip_grad_norm(self, parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor | None:
        """The step's gradient norm before clipping, the gradients clipped to ``trainer.grad_clip_norm``.

        - Call between the backward passes and the optimizer step; hand the value to :meth:`step_done`.
        - None on steps that neither clip nor log (``train/grad_norm``): they pay nothing. No host sync.
        - Under fp16 the gradients are unscaled first.
        """
        self.out_of_memory.past_forward_backward()
        if not self.trainer.grad_clip_norm and (self.progress.step + 1) % self.trainer.log_every_steps:
            return None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        return clip_grad_norm(parameters, self.trainer.grad_clip_norm)

    def step_done(self, samples: int, grad_norm: torch.Tensor | None = None, *, loss: torch.Tensor | None) -> None:
        """Count an optimizer step that used ``samples`` samples on each rank, and watch it.

        - ``loss``: the training loss on the device (``train_sums.running("loss")``), which
          ``trainer.nonfinite`` watches; None raises :class:`~common.errors.UserError`.
        - ``grad_norm``: watched where the step clips; not under fp16 (the grad scaler skips such steps).
        """
        if loss is None:
            raise UserError("run.step_done() got loss=None: hand it the step's training loss on the device "
                            "(train_sums.running(<the name the loop sums its loss under>)), which trainer.nonfinite "
                            "watches")
        self.sampler.advance(samples)
        self.progress.step += 1
        heartbeat.at_step(self.progress.step)
        heartbeat.enter(heartbeat.AFTER_STEP)
        scaler_skips = self.scaler is not None and self.scaler.is_enabled()
        watched_norm = grad_norm if self.trainer.grad_clip_norm and not scaler_skips else None
        self.divergence.observe(self.progress.step, loss, watched_norm)
        self.telemetry.step_done(samples, grad_norm)
        if self._flop_count is not None:
            self.progress.flops_per_sample = self._flop_count.stop() / max(samples, 1)
            self._flop_count = None
        if self._starting:
            self._end_startup(startup.FIRST_STEP)
        self.profiler.step_finished(self.progress.step)
        self._bar.update()

    def _end_startup(self, phase: str | None) -> None:
        """This segment's start-up ends (with ``phase``): kept for the first log and the summary, and printed."""
        self._starting = False
        if self.startup is not None:
            startup.end(self.startup, phase)
            self.console(self.startup.line())

    def log_train(self, metrics: dict[str, float]) -> None:
        """Log training metrics with the telemetry since the previous log (``common/records/telemetry.py``).
        Collective on several ranks."""
        metrics = {**metrics, **self.telemetry.report(self.dist_info.world_size, self.progress.flops_per_sample,
                                                      self.cadence.group)}
        if self.out_of_memory.halves:
            metrics["train/micro_batch_size"] = float(self.micro_batch)
        logged = metrics
        if self.startup is not None and not self._startup_logged:  # in the logs; the console had its line
            self._startup_logged = True
            logged = metrics | {f"startup/{phase}_s": seconds for phase, seconds in self.startup.phases.items()}
        self.logger.log(logged, self.progress.step)
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
        """After :meth:`steps`: close a complete epoch and save its checkpoint, or run a mid-epoch evaluation.

        - Checks first that training is finite (a rollback leaves the epoch unfinished).
        - Evaluates as :class:`~common.run.cadence.EvaluationCadence` says: every ``trainer.eval_every_epochs``
          epochs, or after every ``trainer.eval_every_steps`` steps (where :meth:`steps` ended mid-epoch,
          or an epoch's last step); each evaluation is followed by a checkpoint with its metrics.
        - Early stopping or a search's pruner may end training at an evaluation (the finish then
          evaluates and saves). Saves nothing when training is done: the finish does.
        """
        mid_epoch, self._mid_epoch_evaluation = self._mid_epoch_evaluation, False
        if not self.divergence.check():
            return
        epoch_done = self.plan.epoch_done()
        if epoch_done:
            self.progress.epoch += 1
            self.sampler.set_epoch(self.progress.epoch)
            if self.training_done():
                return
            due = self.evaluations.at_epoch_end(self.progress.epoch, self.progress.step)
        elif mid_epoch:
            due = True
        else:
            return
        metrics = self._evaluate(evaluate) if due else None
        if metrics is not None:
            self._count_improvement(metrics, may_stop=True)
            self._report_to_search(metrics)
        if self.training_done():
            return
        self.save(metrics, milestone=self.milestones.get(self.progress.epoch) if epoch_done else None)

    def _evaluate(self, evaluate: Callable[[], dict[str, float]]) -> dict[str, float]:
        """``evaluate()``, marked in the heartbeat and left out of the step time."""
        with heartbeat.phase(heartbeat.EVALUATION), self.telemetry.excluded():
            return evaluate()

    def _count_improvement(self, metrics: dict[str, float], may_stop: bool) -> None:
        stopped = self.early_stopping.count(self.progress, metrics, may_stop)
        if stopped is not None:
            self.console(stopped)

    def _report_to_search(self, metrics: dict[str, float]) -> None:
        """Report this evaluation to the search this run is a trial of, if any; its pruner may end
        training here (collective: the ranks agree on the study's answer)."""
        if self.search_trial is None:
            return
        at = self.progress.step if self.evaluations.by_steps else self.progress.epoch
        if self.search_trial.report(metrics, at, self.dist_info.is_main):
            metric = self.search_trial.metric
            self.progress.pruned = {"step": self.progress.step, "epoch": self.progress.epoch, "metric": metric,
                                    "value": metrics[metric]}
            self.console(f"pruned by the search at step {self.progress.step} (epoch {self.progress.epoch}): "
                         f"{metric} {metrics[metric]:.4g}; stopping here")

    # ---- checkpoints ----------------------------------------------------------------------------

    def save(self, metrics: dict[str, float] | None = None, milestone: str | None = None) -> None:
        """Checkpoint everything now, with this segment's provenance. Collective."""
        with heartbeat.phase(heartbeat.SAVE):
            self._save(metrics, milestone)

    def _save(self, metrics: dict[str, float] | None, milestone: str | None) -> None:
        now = time.monotonic()
        self.progress.train_seconds += now - self._clock
        self._clock = now
        with self.telemetry.excluded():
            sharded_state = state.sharded_state(self)
            compiled = self.compile_cache.attachment() if self.compile_cache is not None and self.dist_info.is_main\
                else None
            self.checkpoints.save(self.progress.step, state.capture(self), metrics, sharded_state=sharded_state,
                                  milestone=milestone, config=self.config, provenance=self.provenance,
                                  attachments=(compiled,) if compiled else ())
        self.cadence.saved()

    # ---- the finish -----------------------------------------------------------------------------

    def finish(self, evaluate: Callable[[], dict[str, float]], **summary: Any) -> dict[str, float]:
        """Evaluate, save the final checkpoint and write ``summary.json`` (with ``summary``'s entries).

        - A run that was already finished only rewrites its summary.
        - Returns the final metrics; gives the signal handlers back.
        """
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
        if self._starting:  # a segment with no step (a finished run restarted): its start-up up to here
            self._end_startup(None)
        self._stream = None  # the training loader's workers stop
        self.profiler.close()
        self.logger.close()
        self.cadence.close()
        model_digest = state.model_digest(self)
        if self.dist_info.is_main:
            best = self.checkpoints.best()
            for name, obj in self.extra_state.items():
                summary[f"{name}_digest"] = state_digest(obj.state_dict())
            if self.progress.init_from:
                summary["init_from"] = self.progress.init_from
            if self.progress.teacher:
                summary["distill_teacher"] = self.progress.teacher
            if self.progress.rollbacks:
                summary["rollbacks"] = self.progress.rollbacks
            summary["micro_batch_size"] = self.micro_batch
            if self.progress.out_of_memory:
                summary["out_of_memory"] = self.progress.out_of_memory
            if self.early_stopping.patience > 0:
                summary["early_stopping"] = self.early_stopping.summary(self.progress)
            if self.progress.pruned is not None:
                summary["pruned"] = self.progress.pruned
            if self.startup is not None:
                summary["startup"] = {"segment": self.provenance["segment"],  # in order: JSON's keys are sorted
                                      "phases_s": [[phase, round(seconds, 3)]
                                                   for phase, seconds in self.startup.phases.items()]}
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
