"""Loop overhead: the fashion_mnist recipe's training step against a bare PyTorch loop.

The recipe runs for real (``recipes.fashion_mnist.train.train`` with its default config, in this
process), so its steps include everything the shared layer adds: the resumable sampler, the
per-step seeded generator, SumMetrics, the progress bar, TensorBoard logging (every ``SEGMENT``
steps, 5x as often as the default, so each segment holds one logging step) and the checkpoint
cadence checks (the wall-clock check runs every step; no checkpoint falls inside
a timed window). A probe in the cadence check pauses the recipe every ``SEGMENT`` steps and runs
``SEGMENT`` steps of a bare loop (same architecture and initial weights, same optimizer and LR
schedule, the same batches, normalised the same way), so recipe and bare segments interleave
and share whatever else the machine is doing. Overhead is the median over segment pairs of
``recipe / bare - 1``.
"""

from __future__ import annotations

import contextlib
import io
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.results import Result
from common.config import CheckpointConfig
from common.data.sampler import ResumableDistributedSampler
from common.entry import compose_config, typed_config
from common.pytorch.determinism import configure_determinism
from common.pytorch.distributed import init_distributed
from common.pytorch.metrics import SumMetrics
from common.pytorch.optim import warmup_cosine, weight_decay_groups
from common.pytorch.rng import seeded_generator
from common.records.loggers import RunLogger
from common.records.telemetry import StepTelemetry
from common.run.cadence import CheckpointCadence, Decision, StopSignals
from common.run.divergence import NonfiniteWatch
from recipes.fashion_mnist import train as recipe
from recipes.fashion_mnist.config import FashionMNISTConfig
from recipes.fashion_mnist.data import load_split, normalize
from recipes.fashion_mnist.model import build_model
from tools.tiny_data import write_fashion_mnist

BENCHMARK = "loop overhead (fashion_mnist)"
SEGMENT = 10  # steps per timed segment
WARMUP_STEPS = 5


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class BareLoop:
    """What a researcher would write by hand: index, normalise, forward, backward, step."""

    def __init__(self, cfg: FashionMNISTConfig, device: torch.device) -> None:
        torch.manual_seed(cfg.seed)
        self.model = build_model(cfg.model).to(device).to(memory_format=torch.channels_last)
        self.optimizer = torch.optim.AdamW(weight_decay_groups(self.model, cfg.optim.weight_decay), lr=cfg.optim.lr)
        self.images, self.labels = (t.to(device) for t in load_split(cfg.data.root, "train"))
        self.label_smoothing = cfg.optim.label_smoothing
        steps_per_epoch = len(self.images) // cfg.trainer.batch_size
        self.scheduler = warmup_cosine(self.optimizer, round(cfg.optim.warmup_epochs * steps_per_epoch),
                                       steps_per_epoch * cfg.trainer.epochs, cfg.optim.min_lr_ratio)
        order = ResumableDistributedSampler(len(self.images), seed=cfg.seed).global_order(0).to(device)
        self.batches = order.split(cfg.trainer.batch_size)
        self.next_batch = 0  # step k of the recipe trains on batch k - 1 of this order too
        self.model.train()

    def steps(self, count: int) -> None:
        for batch in self.batches[self.next_batch : self.next_batch + count]:
            x = normalize(self.images[batch]).contiguous(memory_format=torch.channels_last)
            loss = F.cross_entropy(self.model(x), self.labels[batch], label_smoothing=self.label_smoothing)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
        self.next_batch += count


def probed_after_step(on_step: Callable[[int], None]) -> Callable[..., Decision]:
    """The run contract's cadence check with a probe that runs first, at every step's end."""
    after_step = CheckpointCadence.after_step

    def probed(cadence: CheckpointCadence, step: int, nonfinite: Callable[[], int], micro_batch: int) -> Decision:
        on_step(step)
        return after_step(cadence, step, nonfinite, micro_batch)

    return probed


class Clocks:
    """Wall-clock and process CPU time: on a shared machine CPU time is what other jobs do not inflate."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def ms_per_step(self, steps: int) -> tuple[float, float]:
        return ((time.perf_counter() - self.wall) * 1000 / steps, (time.process_time() - self.cpu) * 1000 / steps)


def measure(device_name: str, pairs: int, batch_size: int, workdir: Path) -> dict[str, list[float]]:
    """Milliseconds per step of interleaved recipe and bare segments, by wall clock and CPU time."""
    steps = WARMUP_STEPS + pairs * SEGMENT + 1
    data = write_fashion_mnist(workdir / "data", n_train=(steps + 2) * batch_size, n_test=batch_size)
    cfg = typed_config(compose_config("fashion_mnist", [
        f"data.root={data}", f"run_dir={workdir / 'run'}", f"device={device_name}", "trainer.epochs=1",
        f"trainer.batch_size={batch_size}",
        f"trainer.max_steps={steps}", f"trainer.log_every_steps={SEGMENT}", "checkpoint.every_steps=0",
        "checkpoint.every_seconds=1e9",
    ]))
    configure_determinism(cfg.trainer.deterministic, cfg.device)  # as the recipe's main does
    dist_info = init_distributed(cfg.device)
    bare = BareLoop(cfg, dist_info.device)
    bare.steps(WARMUP_STEPS)
    times: dict[str, list[float]] = {"recipe wall": [], "recipe cpu": [], "bare wall": [], "bare cpu": []}
    segment = Clocks()

    def on_step(step: int) -> None:
        nonlocal segment
        if step < WARMUP_STEPS or (step - WARMUP_STEPS) % SEGMENT:
            return
        synchronize(dist_info.device)
        if step > WARMUP_STEPS:
            wall, cpu = segment.ms_per_step(SEGMENT)
            times["recipe wall"].append(wall)
            times["recipe cpu"].append(cpu)
            bare_segment = Clocks()
            bare.steps(SEGMENT)
            synchronize(dist_info.device)
            wall, cpu = bare_segment.ms_per_step(SEGMENT)
            times["bare wall"].append(wall)
            times["bare cpu"].append(cpu)
        segment = Clocks()

    quiet = io.StringIO()
    with mock.patch.object(CheckpointCadence, "after_step", probed_after_step(on_step)), \
            contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        recipe.train(cfg, dist_info)
    return times


class Operators(TorchDispatchMode):
    """Counts the ATen operators dispatched while it is active (autograd's backward included)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (PyTorch's protocol)
        self.calls.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def step_operators(workdir: Path, batch_size: int = 16) -> tuple[Counter, Counter]:
    """The ATen operators of one steady training step on the CPU (the 4th: past the first, whose
    FLOPs are counted; no log, no checkpoint): fashion_mnist's real loop from the end of step 3
    to the end of step 4, and the bare loop's step on the same batch. Their difference is what
    the loop and the shared layer add; on a GPU each is a kernel launch or a host call."""
    counted = 4
    data = write_fashion_mnist(workdir / "data", n_train=(counted + 2) * batch_size, n_test=batch_size)
    cfg = typed_config(compose_config("fashion_mnist", [
        f"data.root={data}", f"run_dir={workdir / 'operators'}", "device=cpu", "trainer.epochs=1",
        f"trainer.batch_size={batch_size}", f"trainer.max_steps={counted + 1}", "trainer.log_every_steps=1000",
        "checkpoint.every_steps=0", "checkpoint.every_seconds=1e9", "logging.backend=none",
        "logging.progress_bar=false",
    ]))
    configure_determinism(cfg.trainer.deterministic, cfg.device)  # as the recipe's main does
    dist_info = init_distributed(cfg.device)
    marks: dict[int, int] = {}
    counting = Operators()
    quiet = io.StringIO()
    with mock.patch.object(CheckpointCadence, "after_step", probed_after_step(lambda step: marks.setdefault(
            step, len(counting.calls)))), contextlib.redirect_stdout(quiet), counting:
        recipe.train(cfg, dist_info)
    bare = BareLoop(cfg, dist_info.device)
    bare.steps(counted - 1)
    with Operators() as bare_step:
        bare.steps(1)
    return Counter(counting.calls[marks[counted - 1]:marks[counted]]), Counter(bare_step.calls)


def bookkeeping_us_per_step(device: torch.device, steps: int, batch_size: int, log_dir: Path) -> float:
    """Microseconds per step of the shared-layer calls the recipe adds to a bare step, alone."""
    logits = torch.randn(batch_size, 10, device=device)
    labels = torch.randint(0, 10, (batch_size,), device=device)
    loss = F.cross_entropy(logits, labels)
    sampler = ResumableDistributedSampler(10**9)
    sums = SumMetrics(device)
    watch = NonfiniteWatch(device)
    stop_signals = StopSignals()
    cadence = CheckpointCadence(CheckpointConfig(every_steps=0, every_seconds=1e9, sync_every_steps=10), stop_signals)
    logger = RunLogger("none", log_dir, True, "bench", progress_bar=False)
    bar = logger.progress(steps, 0, "bookkeeping")
    telemetry = StepTelemetry(device, "fp32")
    batches = telemetry.batches(range(steps))  # the loop's source of micro-batches, timed
    synchronize(device)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        next(batches)
        seeded_generator(device, 0, step, 0)
        sums.add(loss=loss.detach() * len(labels), correct=(logits.argmax(1) == labels).sum(), count=len(labels))
        sampler.advance(len(labels))
        bar.update()
        telemetry.step_done(len(labels), None)
        if step % SEGMENT == 0:
            logger.log({**{name: value / batch_size for name, value in sums.reduce().items()},
                        **telemetry.report(1, None, None)}, step)
            sums.reset()
        watch.observe(step, sums.running("loss"))
        cadence.after_step(step, watch.poll, batch_size)
    synchronize(device)
    elapsed = time.perf_counter() - start
    stop_signals.restore()
    logger.close()
    return elapsed * 1e6 / steps


def run(quick: bool) -> list[Result]:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    batch_size = 32 if quick else 128  # the recipe's default is 128
    results = []
    for device in devices:
        with tempfile.TemporaryDirectory() as workdir:
            times = measure(device, 4 if quick else 30, batch_size, Path(workdir))
            bookkeeping = bookkeeping_us_per_step(torch.device(device), 200 if quick else 2000, batch_size,
                                                  Path(workdir))
        clocks = ["cpu", "wall"] if device == "cpu" else ["wall"]
        for clock in clocks:
            recipe_ms, bare_ms = times[f"recipe {clock}"], times[f"bare {clock}"]
            overheads = [100 * (r / b - 1) for r, b in zip(recipe_ms, bare_ms, strict=True)]
            label = f"{device}, {'process CPU time' if clock == 'cpu' else 'wall clock'}"
            results += [
                Result(BENCHMARK, f"{label}: recipe step", statistics.median(recipe_ms), "ms/step",
                       f"batch {batch_size}; sampler, metrics, logging, progress bar and cadence checks included"),
                Result(BENCHMARK, f"{label}: bare PyTorch step", statistics.median(bare_ms), "ms/step",
                       "same model, optimizer, LR schedule and batches"),
                Result(BENCHMARK, f"{label}: overhead", statistics.median(overheads), "%",
                       f"median of recipe/bare - 1 over {len(overheads)} interleaved pairs of {SEGMENT}-step "
                       f"segments (quartiles {quartiles(overheads)}); target <= 3"),
                Result(BENCHMARK, f"{label}: overhead, fastest segments", 100 * (min(recipe_ms) / min(bare_ms) - 1),
                       "%", "fastest recipe segment / fastest bare segment - 1: a busy machine only adds time"),
            ]
        if device == "cpu":
            with tempfile.TemporaryDirectory() as workdir:
                recipe_ops, bare_ops = step_operators(Path(workdir))
            added = recipe_ops - bare_ops
            results.append(Result(BENCHMARK, "cpu: operators added to a steady step", sum(added.values()),
                                  "operators", f"over the bare step's {sum(bare_ops.values())}: "
                                  + ", ".join(f"{name} x{count}" for name, count in sorted(added.items()))))
        bare_step_ms = statistics.median(times["bare wall" if device == "cuda" else "bare cpu"])
        results.append(Result(
            BENCHMARK, f"{device}: shared-layer calls alone", bookkeeping, "us/step",
            f"{100 * bookkeeping / 1000 / bare_step_ms:.2f}"
            " % of the bare step; seeded generator, SumMetrics.add, sampler.advance, progress bar, the "
            f"telemetry's clocks, logging (metrics.jsonl) every {SEGMENT} steps, cadence check",
        ))
    return results


def quartiles(values: list[float]) -> str:
    low, _, high = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return f"{low:.1f} to {high:.1f}"
