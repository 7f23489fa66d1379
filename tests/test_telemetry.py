"""The telemetry of training logs (common/records/telemetry.py) through the run contract's real loop on a tiny
model: the peak table, the FLOP count, the gradient norm with and without clipping, the time spent
waiting for data, and that a step that does not log makes no collective call."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from common.data.sampler import ResumableDistributedSampler
from common.pytorch.distributed import DistInfo
from common.pytorch.metrics import SumMetrics, ratio
from common.records.loggers import read_metrics_file
from common.records.telemetry import FlopCount, StepTelemetry, device_peak_flops, peak_tflops
from common.run.steps import StepPlan
from common.run.training_run import TrainingRun
from tests.conftest import spawn_ranks
from tests.run_config import run_config

SAMPLES, MICRO_BATCH, FEATURES = 48, 4, 8


def test_the_peak_is_the_devices_for_the_precision_and_unknown_elsewhere() -> None:
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16", tf32=True) == 989.4
    assert peak_tflops("NVIDIA H100 PCIe", "fp16", tf32=False) == 756.5
    assert peak_tflops("NVIDIA H200", "fp32", tf32=True) == 494.7
    assert peak_tflops("NVIDIA H200", "fp32", tf32=False) == 66.9
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16", tf32=True) == 312.0
    assert peak_tflops("NVIDIA L40S", "bf16", tf32=True) == 362.1
    assert peak_tflops("NVIDIA L4", "bf16", tf32=True) == 121.0
    assert peak_tflops("NVIDIA L40", "bf16", tf32=True) is None, "an L40 is not an L4"
    assert peak_tflops("Tesla T4", "bf16", tf32=True) is None
    assert device_peak_flops(torch.device("cpu"), "bf16") is None


def test_the_flops_of_a_linear_layer_are_counted_as_by_hand_and_change_nothing() -> None:
    batch, inputs, outputs = 16, 8, 4
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(inputs, outputs), torch.randn(batch, inputs)
    layer(x).square().sum().backward()
    plain = layer.weight.grad.clone()
    layer.zero_grad()

    count = FlopCount()
    layer(x).square().sum().backward()
    flops = count.stop()
    # Forward: a multiply and an add per weight and sample; backward: the same again for the
    # weight's gradient (the input needs none).
    assert flops == 2 * (2 * batch * inputs * outputs)
    assert torch.equal(layer.weight.grad, plain)


def test_mfu_is_reported_only_where_the_peak_is_known() -> None:
    telemetry = StepTelemetry(torch.device("cpu"), "bf16")
    telemetry.step_done(MICRO_BATCH, None)
    assert "train/mfu" not in telemetry.report(1, flops_per_sample=1e6, group=None)
    telemetry.peak_flops = 1e12
    telemetry.step_done(MICRO_BATCH, None)
    assert telemetry.report(1, flops_per_sample=1e6, group=None)["train/mfu"] > 0
    telemetry.step_done(MICRO_BATCH, None)
    assert "train/mfu" not in telemetry.report(1, flops_per_sample=None, group=None), "not counted yet"


class Points(Dataset):
    """Fixed random points and labels; each item takes ``delay`` seconds to load."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(SAMPLES, FEATURES, generator=generator), torch.arange(SAMPLES) % 2

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay:
            time.sleep(self.delay)
        return self.x[index], self.y[index]


def train_tiny(folder: Path, delay: float = 0.0, grad_clip_norm: float = 0.0, log_every: int = 2, rank: int = 0,
               world_size: int = 1, on_step: object = None) -> tuple[list[dict], list[torch.Tensor | None]]:
    """One epoch of a linear classifier through TrainingRun and a DataLoader (no workers); the
    records of its metrics.jsonl (rank 0) and what ``run.clip_grad_norm`` returned at each step.
    ``on_step(step, logged)`` is called after each step and its logging."""
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    sampler = ResumableDistributedSampler(SAMPLES, rank, world_size, shuffle=False)
    plan = StepPlan(sampler, micro_batch=MICRO_BATCH, accumulate=1, world_size=world_size, epochs=1)
    info = DistInfo(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"), launcher="test")
    sums = SumMetrics(torch.device("cpu"))
    logs = folder / "logs"
    cfg = run_config(folder, trainer={"log_every_steps": log_every, "grad_clip_norm": grad_clip_norm},
                     checkpoint={"sync_every_steps": 1000, "resume": False}, logging={"progress_bar": False})
    run = TrainingRun(cfg, info, plan, model=model, optimizer=optimizer, sampler=sampler, train_sums=sums)
    run.resume()
    loader = DataLoader(Points(delay), batch_size=MICRO_BATCH, sampler=sampler)
    norms = []
    for group in run.steps(loader):
        for x, y in group:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            sums.add(loss=loss.detach() * len(y), count=len(y))
        norms.append(run.clip_grad_norm(model.parameters()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.step_done(group.samples, norms[-1], loss=sums.running("loss"))
        logged = run.progress.step % log_every == 0
        if logged:
            totals = sums.reduce()
            sums.reset()
            run.log_train({"train/loss": ratio(totals, "loss", "count")})
        if on_step is not None:
            on_step(run.progress.step, logged)
    run.cadence.close()
    run.logger.close()
    return (read_metrics_file(logs / "metrics.jsonl") if rank == 0 else []), norms


def test_grad_norm_is_logged_without_clipping_and_is_the_clipped_runs_norm_before_clipping(tmp_path: Path) -> None:
    unclipped, unclipped_norms = train_tiny(tmp_path / "off")
    clip_nothing, every_step = train_tiny(tmp_path / "huge", grad_clip_norm=1e9)
    clipped, _ = train_tiny(tmp_path / "tight", grad_clip_norm=1e-3)
    steps = SAMPLES // MICRO_BATCH
    assert [norm is not None for norm in unclipped_norms] == [step % 2 == 0 for step in range(1, steps + 1)], \
        "without clipping the norm is computed on logging steps only"
    assert all(norm is not None for norm in every_step), "clipping needs it every step"
    assert [record["step"] for record in unclipped] == list(range(2, steps + 1, 2))
    assert [record["train/grad_norm"] for record in unclipped] == [record["train/grad_norm"] for record in
                                                                    clip_nothing]
    # Clipping to 1e-3 changes the weights, so only the first step's gradient is the same; what is logged
    # is the norm before clipping.
    assert clipped[0]["train/grad_norm"] > 1e-3
    unclipped_first, _ = train_tiny(tmp_path / "off-1", log_every=1)
    clipped_first, _ = train_tiny(tmp_path / "tight-1", grad_clip_norm=1e-3, log_every=1)
    assert clipped_first[0]["train/grad_norm"] == unclipped_first[0]["train/grad_norm"]


def test_data_wait_frac_rises_when_the_loader_is_slow(tmp_path: Path) -> None:
    fast, _ = train_tiny(tmp_path / "fast")
    slow, _ = train_tiny(tmp_path / "slow", delay=0.05)  # 0.2 s a step: clear of a loaded machine's own step time
    for records in (fast, slow):
        assert all(0 <= record["train/data_wait_frac"] <= 1 and record["train/step_s"] > 0 for record in records)
    fast_wait = sum(record["train/data_wait_frac"] for record in fast) / len(fast)
    slow_wait = sum(record["train/data_wait_frac"] for record in slow) / len(slow)
    assert slow_wait > fast_wait and slow_wait > 0.5, (fast_wait, slow_wait)


def test_the_loader_is_iterated_when_the_epoch_starts_not_inside_the_first_step() -> None:
    """A DataLoader draws its workers' base seed from torch's global generator when its iterator is
    made; made lazily, at the first micro-batch, that draw lands inside the step's
    ``seeded_global_rng`` and shifts the step's Mixup and drop path draws (a resume was not exact)."""
    loader = DataLoader(list(range(8)), batch_size=4)
    torch.manual_seed(0)
    timed = StepTelemetry(torch.device("cpu"), "fp32").batches(loader)
    after_iter = torch.get_rng_state()
    torch.manual_seed(0)
    iter(loader)
    assert torch.equal(after_iter, torch.get_rng_state())
    assert [batch.tolist() for batch in timed] == [[0, 1, 2, 3], [4, 5, 6, 7]]


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "barrier", "reduce_scatter_tensor", "gather", "scatter", "send", "recv")


def _count_collectives_worker(rank: int, folder: Path) -> None:
    import torch.distributed as dist

    calls = {"count": 0}
    per_step: list[tuple[int, bool, int]] = []

    def counted(function: object) -> object:
        def call(*args: object, **kwargs: object) -> object:
            calls["count"] += 1
            return function(*args, **kwargs)

        return call

    def on_step(step: int, logged: bool) -> None:
        if step == 1:  # from here on: after the set-up's own collectives (resume)
            for name in COLLECTIVES:
                setattr(dist, name, counted(getattr(dist, name)))
        else:
            per_step.append((step, logged, calls["count"]))
        calls["count"] = 0

    records, _ = train_tiny(folder / f"rank{rank}", log_every=3, rank=rank, world_size=2, on_step=on_step)
    (folder / f"rank{rank}.json").write_text(json.dumps({"steps": per_step, "records": records}))


def test_steps_that_do_not_log_make_no_collective_call(tmp_path: Path) -> None:
    """Two gloo ranks: every torch.distributed collective the run contract (and the loop's own
    logging) calls is counted per step. Steps that do not log make none; logging steps gather the
    ranks' step times (and reduce the loss), which the log then shows."""
    spawn_ranks(_count_collectives_worker, tmp_path)
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        counted = seen["steps"]
        assert [step for step, _, _ in counted] == [2, 3, 4, 5, 6]
        assert all(calls == 0 for _, logged, calls in counted if not logged), counted
        assert all(calls > 0 for _, logged, calls in counted if logged), counted
    records = json.loads((tmp_path / "rank0.json").read_text())["records"]
    assert [record["step"] for record in records] == [3, 6]
    assert all(record["train/step_s_slowest_rank"] in (0, 1) and record["train/step_s_max_rank"] > 0
               for record in records)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_no_device_memory_is_reported_on_a_cpu(precision: str) -> None:
    telemetry = StepTelemetry(torch.device("cpu"), precision)
    telemetry.step_done(MICRO_BATCH, torch.tensor(2.0))
    report = telemetry.report(1, flops_per_sample=None, group=None)
    assert "train/max_mem_gib" not in report and report["train/grad_norm"] == 2.0


def _sharded_norm_worker(rank: int, folder: Path) -> None:
    from torch.distributed.fsdp import fully_shard

    from common.records.telemetry import as_float, clip_grad_norm

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(FEATURES, 6), torch.nn.Linear(6, 2))
    sharded = torch.nn.Sequential(torch.nn.Linear(FEATURES, 6), torch.nn.Linear(6, 2))
    sharded.load_state_dict(plain.state_dict())
    fully_shard(sharded)
    x = torch.randn(MICRO_BATCH, FEATURES, generator=torch.Generator().manual_seed(1))
    plain(x).square().sum().backward()
    sharded(x).square().sum().backward()  # the same batch on both ranks: the same gradients as the plain copy
    expected = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in plain.parameters()])))
    norm = clip_grad_norm(sharded.parameters(), 0.0)
    clipped_norm = clip_grad_norm(sharded.parameters(), 0.5)
    after = float(torch.linalg.vector_norm(torch.stack([p.grad.full_tensor().norm() for p in sharded.parameters()])))
    (folder / f"rank{rank}.json").write_text(json.dumps(
        {"expected": expected, "norm": as_float(norm), "clipped_norm": as_float(clipped_norm), "after": after}))


def test_the_norm_of_fsdp2_sharded_gradients_is_the_whole_models(tmp_path: Path) -> None:
    """FSDP2's gradients are DTensor shards: the norm (and clipping) is the whole model's on every rank."""
    spawn_ranks(_sharded_norm_worker, tmp_path)
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["norm"] == pytest.approx(seen["expected"], rel=1e-6) and seen["expected"] > 0.5
        assert seen["clipped_norm"] == pytest.approx(seen["expected"], rel=1e-6), "the norm before clipping"
        assert seen["after"] == pytest.approx(0.5, rel=1e-4)


def test_images_per_s_counts_the_time_step_s_counts_in_a_window_that_holds_a_slow_evaluation(
        tmp_path: Path, fashion_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fashion_mnist, 16 steps an epoch, a log every 6: the window of steps 13-18 holds the first epoch's
    evaluation (made to sleep 0.5 s) and its save. Its images/s is its samples over the time step_s counts,
    so images/s x step_s is the samples of a step there as in every window, and the evaluation lowers neither."""
    from recipes.fashion_mnist import train as fashion_mnist
    from tests.recipe_probe import Configs, probe

    evaluator = fashion_mnist.evaluator

    def slow_evaluator(*args: object) -> object:
        evaluate = evaluator(*args)

        def slow(*inner: object, **kwargs: object) -> dict[str, float]:
            time.sleep(0.5)
            return evaluate(*inner, **kwargs)

        return slow

    monkeypatch.setattr(fashion_mnist, "evaluator", slow_evaluator)
    configs = Configs("fashion_mnist", tmp_path, ["model.channels=[4,8]", "model.hidden=16", "trainer.batch_size=16",
                                                  f"data.root={fashion_data}", "trainer.epochs=2",
                                                  "trainer.log_every_steps=6", "logging.backend=none",
                                                  "checkpoint.every_seconds=0"])
    seen = probe("fashion_mnist", configs(), steps=None)
    assert seen.error is None
    records = read_metrics_file(Path(seen.cfg.run_dir) / "tensorboard" / "metrics.jsonl")
    evaluated_at = [record["step"] for record in records if "eval/top1" in record]
    windows = [record for record in records if "train/images_per_s" in record]
    assert [record["step"] for record in windows] == [6, 12, 18, 24, 30] and evaluated_at[0] == 16
    for record in windows:
        assert record["train/images_per_s"] * record["train/step_s"] == pytest.approx(16, rel=1e-9), record
