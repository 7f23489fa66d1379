"""``data.decode=auto`` (common/data/decode_choice.py): the CPU while the rank's cores keep up with the
model on its GPU, else the GPU; the CPU where only it can run or where timings must not decide; the
measurements leave the model and the random generators as they were."""

from __future__ import annotations

import pytest
import torch

from common.config import Decode
from common.data.decode_choice import HEADROOM, choose_decode, core_rate, model_rate

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
