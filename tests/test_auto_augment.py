"""TrivialAugmentWide and RandAugment for whole batches (``common/data/auto_augment.py``): torchvision's
images for a fixed seed, torchvision's distribution, and no per-image or syncing work on the device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from scipy.stats import ks_2samp
from torch.utils._python_dispatch import TorchDispatchMode
from torchvision.transforms import v2

from common.config import Decode
from common.data.auto_augment import BatchAutoAugment, batch_policy
from common.data.device_input import DeviceTrainInput
from common.data.images import TrainAugmentation
from common.errors import UserError
from tests.test_host_syncs import syncing_ops

POLICIES = {  # ours, torchvision's
    "TrivialAugmentWide": (BatchAutoAugment.trivial_augment_wide(), v2.TrivialAugmentWide()),
    "TrivialAugmentWide bilinear": (BatchAutoAugment.trivial_augment_wide(interpolation="bilinear"),
                                    v2.TrivialAugmentWide(interpolation=v2.InterpolationMode.BILINEAR)),
    "RandAugment(2, 9)": (BatchAutoAugment.rand_augment(2, 9), v2.RandAugment(num_ops=2, magnitude=9)),
    "RandAugment(2, 20)": (BatchAutoAugment.rand_augment(2, 20), v2.RandAugment(num_ops=2, magnitude=20)),
}


def photos(count: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    """uint8 images with a photo's smooth structure (flat random images hide what equalize,
    autocontrast and sharpness do)."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.rand(count, 3, 1, 1, generator=generator) * 180
    detail = F.interpolate(torch.rand(count, 3, 6, 6, generator=generator) * 90, size=(height, width),
                           mode="bilinear")
    return (base + detail).clamp(0, 255).to(torch.uint8)


def batched(policy: BatchAutoAugment, images: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    draws = [policy.draw(*images.shape[-2:]) for _ in range(len(images))]
    return policy.apply(images, draws)


def one_by_one(policy: v2.Transform, images: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.stack([policy(image) for image in images])


@pytest.mark.parametrize(("name", "height", "width"), [*((name, 41, 57) for name in POLICIES),
                                                       ("TrivialAugmentWide", 32, 32)])
def test_a_fixed_seed_gives_torchvision_s_images(name: str, height: int, width: int) -> None:
    """The same draws from the same generator, and each op computed as torchvision computes it on
    uint8: equal images, but for a grey level where float rounding differs. 150 images draw every
    op of each policy several times; a non-square size checks each geometric op's centre."""
    ours, theirs = POLICIES[name]
    images = photos(150, height, width)
    difference = (batched(ours, images, seed=5).int() - one_by_one(theirs, images, seed=5).int()).abs()
    assert difference.max() <= 1 and (difference > 0).float().mean() < 1e-4, \
        f"{name}: {int((difference > 0).sum())} pixels differ, by up to {int(difference.max())}"


@pytest.mark.parametrize("name", ["TrivialAugmentWide", "RandAugment(2, 20)"])
def test_the_images_follow_torchvision_s_distribution(name: str) -> None:
    """Independent seeds: per-image statistics of ours and torchvision's come from one distribution."""
    ours, theirs = POLICIES[name]
    images = photos(1000, 24, 24, seed=1)
    mine, reference = batched(ours, images, seed=11).float(), one_by_one(theirs, images, seed=12).float()
    moved = mine - images.float()
    for statistic, of in {
        "mean": lambda batch: batch.mean((1, 2, 3)),
        "contrast": lambda batch: batch.std((1, 2, 3)),
        "black pixels": lambda batch: (batch == 0).float().mean((1, 2, 3)),
        "change": lambda batch: (batch - images.float()).abs().mean((1, 2, 3)),
    }.items():
        result = ks_2samp(of(mine).numpy(), of(reference).numpy())
        assert result.pvalue > 0.001, f"{name}, {statistic}: the distributions differ (KS p={result.pvalue:.2g})"
    assert (moved != 0).any((1, 2, 3)).float().mean() > 0.5, "most images must change"


class DeviceOps(TorchDispatchMode):
    """Counts the operators run (each one a kernel launch or more on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (PyTorch's protocol)
        self.count += 1
        return func(*args, **(kwargs or {}))


def every_op(policy: BatchAutoAugment, count: int, height: int, width: int) -> list:
    """``count`` draws that use every op of the policy, in turn."""
    torch.manual_seed(0)
    draws = [policy.draw(height, width) for _ in range(count)]
    names = list(policy.space)
    return [[(names[i % len(names)], magnitude) for _, magnitude in draw] for i, draw in enumerate(draws)]


@pytest.mark.parametrize("name", ["TrivialAugmentWide", "RandAugment(2, 9)"])
def test_a_batch_costs_the_same_operators_whatever_its_size_and_none_syncs(name: str) -> None:
    """Per op present, not per image: torchvision's policy, image by image, ran thousands of
    kernels and two blocking copies per affine op for a batch."""
    policy = POLICIES[name][0]
    counts = {}
    for size in (56, 224):
        images, draws = photos(size, 32, 32), every_op(policy, size, 32, 32)
        with DeviceOps() as ops:
            policy.apply(images, draws)
        counts[size] = ops.count
        assert syncing_ops(lambda: policy.apply(images, draws)) == []
    assert counts[224] == counts[56] < 40 * policy.num_ops * len(policy.space)


def test_torchvision_s_policies_map_to_batched_ones_and_others_are_refused_on_the_device() -> None:
    assert repr(batch_policy(v2.TrivialAugmentWide(interpolation=v2.InterpolationMode.BILINEAR))) == \
        "BatchAutoAugment: TrivialAugmentWide(num_magnitude_bins=31, interpolation=bilinear)"
    assert "RandAugment(num_ops=2, magnitude=20, " in repr(batch_policy(v2.RandAugment(num_ops=2, magnitude=20)))
    augmentation = TrainAugmentation(size=16, per_sample=v2.AutoAugment())
    with pytest.raises(UserError, match=r"^data.decode=gpu runs the per-sample policy on whole batches .* use "
                                        r"data.decode=cpu$"):
        DeviceTrainInput(augmentation, Decode.gpu, (0.5,) * 3, (0.5,) * 3, torch.device("cpu"))
    DeviceTrainInput(augmentation, Decode.cpu, (0.5,) * 3, (0.5,) * 3, torch.device("cpu"))  # workers run it
