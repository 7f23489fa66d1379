"""``data.decode=auto`` (common/data/decode_choice.py): the CPU while the rank's cores keep up with the
model on its GPU, else the GPU; the CPU where only it can run or where timings must not decide; the
measurements leave the model and the random generators as they were, and a model that runs out of
memory is measured with a smaller batch. In the recipes (measured as on a GPU): the model is measured
at the run's micro-batch, the resumed one; a resume decodes as the run began."""

from __future__ import annotations

import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from common.config import Decode
from common.data import decode_choice
from common.data.decode_choice import HEADROOM, choose_decode, core_rate, model_rate
from common.run import state
from tests.recipe_probe import Configs, probe, tiny_settings

CUDA = torch.device("cuda")  # only its type is read: the rates are given
CPU = torch.device("cpu")


def never() -> float:
    raise AssertionError("measured where the choice did not need it")


def choose(configured: Decode = Decode.auto, device: torch.device = CUDA, deterministic: bool = False,
           unsupported: str | None = None, workers: int = 8, per_core: float = 100.0, demand: float = 500.0):  # noqa: ANN201
    return choose_decode(configured, device=device, deterministic=deterministic, gpu_unsupported=unsupported,
                         workers=workers, core_rate=lambda: per_core, model_rate=lambda: demand)


def test_a_configured_decode_is_kept_and_nothing_is_measured() -> None:
    for configured in (Decode.cpu, Decode.gpu):
        choice = choose_decode(configured, device=CUDA, deterministic=False, gpu_unsupported=None, workers=1,
                               core_rate=never, model_rate=never)
        assert (choice.decode, choice.reason) == (configured, f"data.decode={configured.value}")


def test_auto_is_the_cpu_where_the_gpu_path_cannot_run_or_timings_must_not_decide() -> None:
    cases = {"the device is not a GPU": dict(device=CPU),
             "a timm policy": dict(unsupported="a timm policy"),
             "trainer.deterministic=true": dict(deterministic=True)}
    for reason, case in cases.items():
        choice = choose_decode(Decode.auto, **{"device": CUDA, "deterministic": False, "gpu_unsupported": None,
                                               **{("gpu_unsupported" if k == "unsupported" else k): v
                                                  for k, v in case.items()}},
                               workers=1, core_rate=never, model_rate=never)
        assert choice.decode == Decode.cpu and reason in choice.reason and choice.reason.startswith("data.decode=auto")


def test_auto_decodes_on_the_cpu_while_its_cores_keep_up_with_the_model_and_on_the_gpu_below() -> None:
    demand, per_core = 500.0, 100.0
    enough = choose(workers=6, per_core=per_core, demand=demand)  # 600 >= 1.1 x 500
    assert enough.decode == Decode.cpu
    assert "6 loader worker(s) decode ~600 images/s (~100 per core)" in enough.reason
    assert f"the CPU keeps up from {HEADROOM * demand / per_core:.1f} cores" in enough.reason
    assert choose(workers=5, per_core=per_core, demand=demand).decode == Decode.gpu  # 500 < 550
    assert choose(workers=0, per_core=10_000.0, demand=demand).decode == Decode.cpu, "0 workers: the main process"


def test_the_decode_rate_is_per_core_and_skips_the_first_call() -> None:
    calls = []

    def decode_one(index: int) -> None:
        calls.append(index)
        end = torch.randn(200, 200)
        for _ in range(5):
            end = end @ end.T / 200

    rate = core_rate(decode_one, count=4)
    assert calls == [0, 1, 2, 3] and rate > 0


def test_measuring_the_model_leaves_its_weights_buffers_gradients_and_the_generators_as_they_were() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Dropout(0.5),
                                torch.nn.Flatten(), torch.nn.LazyLinear(2))
    model(torch.randn(2, 3, 8, 8))
    before = {name: value.clone() for name, value in model.state_dict().items()}
    generator = torch.get_rng_state()
    rate = model_rate(model, batch=4, image_size=8, precision="fp32", channels_last=False, device=CPU)
    assert rate > 0
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert all(param.grad is None for param in model.parameters())
    assert torch.equal(torch.get_rng_state(), generator)


def test_the_pipelines_refuse_an_unresolved_auto() -> None:
    from common.data.device_input import DeviceTrainInput
    from common.data.images import PathImages, TrainAugmentation, TrainImages

    with pytest.raises(ValueError, match="resolved first"):
        DeviceTrainInput(TrainAugmentation(size=8), Decode.auto, [0.5] * 3, [0.5] * 3, CPU)
    with pytest.raises(ValueError, match="resolved first"):
        TrainImages(PathImages([], []), TrainAugmentation(size=8), Decode.auto)


class RunsOutAbove(torch.nn.Module):
    """A convolution that raises CUDA's out-of-memory error for more than ``fits`` samples; records each batch."""

    def __init__(self, fits: int) -> None:
        super().__init__()
        self.fits, self.batches = fits, []
        self.conv, self.norm = torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.batches.append(len(images))
        output = self.norm(self.conv(images))
        if len(images) > self.fits:
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")
        return output


def test_a_model_that_runs_out_of_memory_is_measured_with_half_the_batch_and_left_as_it_was() -> None:
    model = RunsOutAbove(fits=2)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    generator = torch.get_rng_state()
    assert model_rate(model, batch=8, image_size=8, precision="fp32", channels_last=False, device=CPU) > 0
    assert model.batches == [8, 4, 2, 2, 2], "halved down to what fits, then one untimed and two timed steps"
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert all(param.grad is None for param in model.parameters())
    assert torch.equal(torch.get_rng_state(), generator)


def test_a_model_that_does_not_fit_one_sample_decodes_on_the_cpu_without_stopping() -> None:
    model = RunsOutAbove(fits=0)
    assert model_rate(model, batch=3, image_size=8, precision="fp32", channels_last=False, device=CPU) == 0.0
    assert model.batches == [3, 2, 1]
    choice = choose(demand=0.0)
    assert choice.decode == Decode.cpu and "ran out of GPU memory with one sample" in choice.reason


def test_a_resume_keeps_the_choice_its_checkpoint_holds_and_a_set_decode_changes_it_in_one_line() -> None:
    kept = choose_decode(Decode.auto, device=CUDA, deterministic=False, gpu_unsupported=None, workers=1,
                         core_rate=never, model_rate=never, resumed=Decode.gpu)
    assert kept.decode == Decode.gpu and "as the run chose at its start" in kept.reason
    changed = choose_decode(Decode.cpu, device=CUDA, deterministic=False, gpu_unsupported=None, workers=1,
                            core_rate=never, model_rate=never, resumed=Decode.gpu)
    assert changed.decode == Decode.cpu
    assert changed.reason == ("data.decode=cpu, set for this resume: the run decoded on the gpu before, so from here "
                              "on it draws other augmentations than an uninterrupted run would")
    moved = choose_decode(Decode.auto, device=CPU, deterministic=False, gpu_unsupported=None, workers=1,
                          core_rate=never, model_rate=never, resumed=Decode.gpu)
    assert moved.decode == Decode.cpu and "decoded on the GPU before this resume" in moved.reason


# ---- in the recipes: data.decode=auto measured as on a GPU ------------------------------------------

TIMM = "timm_imagenet"


class ForcedMeasurement:
    """``data.decode=auto`` measured in the recipes as on a GPU: the device taken for one, the CPU's
    decode rate measured, the model's rate ``demand``; the micro-batch each measurement asked for kept."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, demand: float) -> None:
        self.demand, self.batches = demand, []
        real = decode_choice.choose_decode
        monkeypatch.setattr(decode_choice, "choose_decode",
                            lambda configured, *, device, **others: real(configured, device=CUDA, **others))
        monkeypatch.setattr(decode_choice, "model_rate", self.model_rate)

    def model_rate(self, model: torch.nn.Module, batch: int, *args: object) -> float:
        self.batches.append(batch)
        return self.demand


def test_a_resumed_run_whose_checkpoint_holds_no_choice_measures_the_model_at_its_halved_micro_batch(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that halved its micro-batch from 4 to 2 in step 2 and stopped after step 3, its checkpoints
    written as before the choice was kept: resumed on the same device, it measures at 2."""
    forced = ForcedMeasurement(monkeypatch, demand=1.0)
    configs = Configs(TIMM, tmp_path, [*tiny_settings(TIMM, tmp_path_factory), "trainer.batch_size=4",
                                       "trainer.global_batch_size=8", "trainer.max_steps=4", "checkpoint.every_steps=1",
                                       "trainer.out_of_memory=halve"])
    interrupted = configs()
    with monkeypatch.context() as older:
        older.setattr(state, "asdict", lambda progress: {name: value for name, value in asdict(progress).items()
                                                         if name != "decode"})
        first = probe(TIMM, interrupted, steps=3, error_at=2)
    assert first.error is None and first.run.micro_batch == 2 and forced.batches == [4]
    resumed = probe(TIMM, interrupted, steps=None)
    assert resumed.error is None and resumed.run.micro_batch == 2
    assert forced.batches == [4, 2]


def test_a_resume_decodes_as_the_run_began_and_ends_with_the_digest_of_an_uninterrupted_run(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Chosen on the GPU at the start (the CPU could not keep up); resumed where the CPU would keep up:
    still the GPU, nothing measured, the uninterrupted run's digest. A data.decode set to the CPU for the
    resume changes it, in one line."""
    forced = ForcedMeasurement(monkeypatch, demand=1e9)
    configs = Configs(TIMM, tmp_path, [*tiny_settings(TIMM, tmp_path_factory), "trainer.max_steps=4",
                                       "checkpoint.every_steps=1"])
    uninterrupted = probe(TIMM, configs(), steps=None)
    interrupted = configs()
    probe(TIMM, interrupted, steps=2)
    assert forced.batches == [8, 8] and uninterrupted.run.progress.decode == "gpu"
    shutil.copytree(interrupted.run_dir, tmp_path / "copy", symlinks=True)  # resumed by the link's directory name
    forced.demand = 1.0
    capsys.readouterr()
    resumed = probe(TIMM, interrupted, steps=None)
    assert forced.batches == [8, 8], "the resume measured again"
    assert resumed.run.progress.decode == "gpu"
    assert "data.decode=auto: on the gpu, as the run chose at its start" in capsys.readouterr().out
    assert resumed.summary["model_digest"] == uninterrupted.summary["model_digest"]

    set_for_the_resume = probe(TIMM, configs(f"run_dir={tmp_path / 'copy'}", "data.decode=cpu"), steps=None)
    assert set_for_the_resume.error is None, set_for_the_resume.error
    assert set_for_the_resume.run.progress.decode == "cpu"
    assert "data.decode=cpu, set for this resume: the run decoded on the gpu before" in capsys.readouterr().out
    assert set_for_the_resume.summary["model_digest"] != uninterrupted.summary["model_digest"]
