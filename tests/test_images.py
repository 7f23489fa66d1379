"""common/data/images.py: crop boxes drawn as timm and torchvision draw them, the uint8 CPU path and the
device path (run here with device=cpu) against timm's own transform, colour jitter against
torchvision's, odd files (greyscale, CMYK, a PNG named .JPEG, a truncated JPEG), DCT scaling, and
the default worker count."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.stats import ks_2samp
from timm.data import create_transform
from timm.data.transforms import RandomResizedCropAndInterpolation
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import Dataset
from torchvision.ops import roi_align
from torchvision.transforms import RandomResizedCrop
from torchvision.transforms.v2 import functional as tvf

from common.config import Decode
from common.data.device_input import DeviceTrainInput, colour_jitter
from common.data.images import (
    CropBox,
    PathImages,
    ResizedImages,
    TrainAugmentation,
    TrainImages,
    collate_train,
    dct_reduction,
    random_resized_crop,
    read_file,
    read_header,
)
from common.data.loaders import PerSampleSeeded, cpu_cores_per_rank, make_loader
from common.data.sampler import ResumableDistributedSampler
from common.errors import UserError
from tools.tiny_data import write_jpeg_cases

SIZE = 48
CPU = torch.device("cpu")
TIMM_DEFAULT = TrainAugmentation(size=SIZE, colour_jitter=0.4)  # timm's create_transform defaults, bilinear


@pytest.fixture(scope="session")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_jpeg_cases(tmp_path_factory.mktemp("jpegs"))


def pixels_0_255(augmentation: TrainAugmentation, decode: Decode, samples: list[dict],
                 device: torch.device = CPU) -> torch.Tensor:
    """What the model would see, before normalisation (mean 0, std 1/255), on the CPU."""
    to_model = DeviceTrainInput(augmentation, decode, (0.0, 0.0, 0.0), (1 / 255,) * 3, device)
    batch, _ = collate_train([(sample, 0) for sample in samples])
    return to_model(batch).cpu()


# ---- crop boxes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("width, height", [(500, 375), (2000, 1500), (640, 120)])
def test_crop_boxes_are_timm_s_for_a_fixed_seed_and_torchvision_s_in_distribution(width: int, height: int) -> None:
    scale, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
    random.seed(11)
    ours = [random_resized_crop(width, height, scale, ratio) for _ in range(3000)]
    random.seed(11)
    image = Image.new("RGB", (width, height))
    timm_boxes = [CropBox(*RandomResizedCropAndInterpolation.get_params(image, scale, ratio)) for _ in range(3000)]
    assert ours == timm_boxes

    torch.manual_seed(11)
    torchvision_boxes = [CropBox(*RandomResizedCrop.get_params(image, scale, ratio)) for _ in range(3000)]
    for name, statistic in {
        "area": lambda b: b.height * b.width / (width * height),
        "aspect": lambda b: math.log(b.width / b.height),
        "centre x": lambda b: (b.left + b.width / 2) / width,
        "centre y": lambda b: (b.top + b.height / 2) / height,
    }.items():
        result = ks_2samp([statistic(b) for b in ours], [statistic(b) for b in torchvision_boxes])
        assert result.pvalue > 0.001, f"{name}: the box distributions differ (KS p={result.pvalue:.2g})"
    assert all(0 <= b.top and b.top + b.height <= height and 0 <= b.left and b.left + b.width <= width for b in ours)
    if width / height > 4 / 3:  # too wide for every try: some boxes are timm's fallback, the centred crop
        assert any(b.height == height for b in ours)


def test_dct_reduction_is_the_largest_that_keeps_the_crop_at_least_the_output_size() -> None:
    assert dct_reduction(CropBox(0, 0, 95, 500), 48) == 1
    assert dct_reduction(CropBox(0, 0, 96, 500), 48) == 2
    assert dct_reduction(CropBox(0, 0, 400, 390), 48) == 8
    assert dct_reduction(CropBox(0, 0, 5000, 5000), 48) == 8  # libjpeg scales down to 1/8 at most
    rng = random.Random(3)
    for _ in range(500):
        box = CropBox(0, 0, rng.randint(1, 2000), rng.randint(1, 2000))
        reduction = dct_reduction(box, 224)
        assert reduction == 1 or min(box) // reduction >= 224 or min(box.height, box.width) / reduction >= 224
        assert reduction == 8 or min(box.height, box.width) / (2 * reduction) < 224


# ---- images against the reference transform -------------------------------------------------------


class _TimmReference(Dataset):
    """timm's training transform as the recipe used it before: PIL decoding and operations, uint8 out."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self.transform = create_transform((3, SIZE, SIZE), is_training=True, interpolation="bilinear",
                                          color_jitter=0.4, use_prefetcher=True)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        with Image.open(self.paths[index]) as image:
            return self.transform(image.convert("RGB"))


@pytest.mark.parametrize("case", ["rgb", "large"])
def test_a_fixed_seed_gives_timm_s_image_within_interpolation_differences(cases: dict[str, Path], case: str) -> None:
    """Same seed, same (epoch, index): the same box, flip and colour-jitter factors as timm's
    PIL transform, on both paths. What differs is how pixels are resampled: antialiased resizing
    in torch instead of PIL (``large`` is also decoded at a reduced DCT scale, and the device path
    averages bilinear samples with roi_align), and colour jitter in float instead of uint8 steps."""
    paths, mean_tolerance = [cases[case]] * 12, 2.5  # 0-255 levels; a wrong box differs by about 60
    reference = PerSampleSeeded(_TimmReference(paths), seed=5)
    keys = [(epoch, index) for epoch in range(2) for index in range(6)]
    expected = torch.stack([reference[key] for key in keys]).float()
    wrong_box = torch.stack([reference[(9, index)] for index in range(12)]).float()
    assert (wrong_box - expected).abs().mean() > 3 * mean_tolerance, "the comparison must tell crops apart"
    for decode in (Decode.cpu, Decode.gpu):  # the two decoders; auto chooses one of them
        ours = PerSampleSeeded(TrainImages(PathImages([str(p) for p in paths], [0] * 12), TIMM_DEFAULT, decode), seed=5)
        images = pixels_0_255(TIMM_DEFAULT, decode, [ours[key][0] for key in keys])
        difference = (images - expected).abs()
        assert difference.mean() < mean_tolerance, f"{decode.value}: mean difference {difference.mean():.2f}"
        assert difference.quantile(0.99) < 4 * mean_tolerance, f"{decode.value}: {difference.quantile(0.99):.1f}"


def test_both_paths_give_the_same_crops_whatever_the_file(cases: dict[str, Path]) -> None:
    """Greyscale and CMYK JPEGs and a PNG named .JPEG are decoded by the worker on the device path
    too (nvjpeg takes three-component JPEGs only); the crops match the CPU path's."""
    augmentation = TrainAugmentation(size=SIZE, scale=(0.3, 1.0))
    names = ["rgb", "large", "greyscale", "cmyk", "png"]
    on_device = TrainImages(PathImages([str(cases[n]) for n in names], list(range(5))), augmentation, Decode.gpu)
    in_worker = TrainImages(PathImages([str(cases[n]) for n in names], list(range(5))), augmentation, Decode.cpu)
    device_samples = [PerSampleSeeded(on_device, 1)[(0, i)][0] for i in range(5)]
    worker_samples = [PerSampleSeeded(in_worker, 1)[(0, i)][0] for i in range(5)]
    assert [s["shape"][0].item() > 0 for s in device_samples] == [False, False, True, True, True]
    device_images = pixels_0_255(augmentation, Decode.gpu, device_samples)
    worker_images = pixels_0_255(augmentation, Decode.cpu, worker_samples)
    for name, device_image, worker_image in zip(names, device_images, worker_images):
        assert (device_image - worker_image).abs().mean() < 4, name
    grey = worker_images[names.index("greyscale")]
    assert torch.equal(grey[0], grey[1]) and torch.equal(grey[1], grey[2])
    with Image.open(cases["cmyk"]) as cmyk:
        assert cmyk.mode == "CMYK"
        reference = torch.from_numpy(np.array(cmyk.convert("RGB"))).permute(2, 0, 1)
    whole = ResizedImages(PathImages([str(cases["cmyk"])], [0]), 30)[0][0]
    assert (whole.float() - tvf.resize(reference, [30, 30], antialias=True).float()).abs().mean() < 2


def test_a_truncated_jpeg_is_a_user_error_naming_it_on_both_paths(cases: dict[str, Path]) -> None:
    path = str(cases["truncated"])
    assert read_header(read_file(path), path)[:2] == (120, 90), "the header is intact: decoding must find it"
    augmentation = TrainAugmentation(size=SIZE)
    with pytest.raises(UserError, match=f"^{path} is not a readable image"):
        TrainImages(PathImages([path], [0]), augmentation, Decode.cpu)[0]
    samples = TrainImages(PathImages([str(cases["rgb"]), path], [0, 1]), augmentation, Decode.gpu)
    batch, _ = collate_train([samples[0], samples[1]])
    with pytest.raises(UserError, match=f"^{path} is not a readable image"):
        DeviceTrainInput(augmentation, Decode.gpu, (0.5,) * 3, (0.5,) * 3, CPU)(batch)
    (Path(path).parent / "empty.JPEG").write_bytes(b"")
    with pytest.raises(UserError, match="empty.JPEG is not a readable image"):
        TrainImages(PathImages([str(Path(path).parent / "empty.JPEG")], [0]), augmentation, Decode.gpu)[0]


def test_the_device_path_runs_the_policy_on_uint8_seeded_per_sample(cases: dict[str, Path]) -> None:
    """A torchvision policy on the device draws from a seed the worker drew: the same sample
    gives the same image, different samples differ; timm's PIL policies are refused there."""
    from torchvision.transforms import v2

    augmentation = TrainAugmentation(size=SIZE, per_sample=v2.RandAugment(num_ops=2, magnitude=20))
    files = PathImages([str(cases["rgb"])] * 4, [0] * 4)
    dataset = PerSampleSeeded(TrainImages(files, augmentation, Decode.gpu), seed=2)
    first = pixels_0_255(augmentation, Decode.gpu, [dataset[(0, i)][0] for i in range(4)])
    again = pixels_0_255(augmentation, Decode.gpu, [dataset[(0, i)][0] for i in range(4)])
    assert torch.equal(first, again)
    plain = TrainAugmentation(size=SIZE)
    unaugmented = pixels_0_255(plain, Decode.gpu, [PerSampleSeeded(TrainImages(files, plain, Decode.gpu), 2)[(0, i)][0]
                                                  for i in range(4)])
    assert not torch.equal(first, unaugmented)
    pil_policy = TrainAugmentation(size=SIZE, per_sample=lambda image: image, per_sample_takes_pil=True)
    with pytest.raises(UserError, match="works on PIL images only"):
        DeviceTrainInput(pil_policy, Decode.gpu, (0.5,) * 3, (0.5,) * 3, CPU)


class FloatCopies(TorchDispatchMode):
    """Records the number of elements of every float32 copy made (``.float()``, ``.to(float32)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (PyTorch's protocol)
        result = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and result.dtype == torch.float32:
            self.sizes.append(result.numel())
        return result


def test_device_crops_cut_each_image_to_its_box_in_uint8_before_the_float_conversion() -> None:
    """decode=gpu: a small box of a large photo becomes float at the size of the box (plus the
    pixel of margin bilinear sampling reads), with the pixels roi_align gives on the whole image."""
    to_model = DeviceTrainInput(TrainAugmentation(size=16), Decode.gpu, (0.0,) * 3, (1 / 255,) * 3, CPU)
    generator = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, 600, 800), dtype=torch.uint8, generator=generator) for _ in range(2)]
    images.append(torch.randint(0, 256, (3, 90, 40), dtype=torch.uint8, generator=generator))
    boxes = torch.tensor([[100.5, 200.25, 40.0, 30.5], [560.0, 0.0, 40.0, 50.0], [0.0, 0.0, 90.0, 40.0]])
    with FloatCopies() as copies:
        crops = to_model.resized_crops(images, boxes, 16)
    # The boxes and a pixel around them, not past an edge: rows 99-141 and columns 199-231, rows
    # 559-599 and columns 0-50; the small image is all box.
    assert copies.sizes == [3 * 43 * 33, 3 * 41 * 51, 3 * 90 * 40]
    for image, box, crop in zip(images, boxes.tolist(), crops):
        top, left, height, width = box
        whole = roi_align(image[None].float(), torch.tensor([[0, left, top, left + width, top + height]]), 16,
                          spatial_scale=1.0, sampling_ratio=-1, aligned=True)[0]
        torch.testing.assert_close(crop, whole, rtol=0, atol=1e-2)


def test_a_torchvision_without_a_device_decoder_stops_decode_gpu_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """When torchvision drops its decoders (deprecated in 0.29), data.decode=gpu refuses to start
    rather than decode every image on the CPU of the training process."""
    import torchvision

    def removed(*args: object, **kwargs: object) -> None:
        raise RuntimeError("decode_jpeg was removed: use TorchCodec")

    monkeypatch.setattr(torchvision.io, "decode_jpeg", removed)
    with pytest.raises(UserError, match=r"^data.decode=gpu: torchvision \S+ cannot decode JPEGs on cpu "
                                        r"\(decode_jpeg was removed: use TorchCodec\); use data.decode=cpu$"):
        DeviceTrainInput(TrainAugmentation(size=SIZE), Decode.gpu, (0.5,) * 3, (0.5,) * 3, CPU)
    DeviceTrainInput(TrainAugmentation(size=SIZE), Decode.cpu, (0.5,) * 3, (0.5,) * 3, CPU)  # cpu needs none


def test_colour_jitter_on_the_device_is_torchvision_s_per_sample() -> None:
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (6, 3, 16, 16), generator=generator).float()
    params = torch.stack([torch.cat([torch.rand(3, generator=generator) * 0.8 + 0.6,
                                     torch.randperm(4, generator=generator).float()]) for _ in range(6)])
    jittered = colour_jitter(images.clone(), params)
    adjust = {0: tvf.adjust_brightness, 1: tvf.adjust_contrast, 2: tvf.adjust_saturation}
    for image, sample_params, result in zip(images, params, jittered):
        expected = image / 255
        for op in sample_params[3:].long().tolist():
            if op in adjust:
                expected = adjust[op](expected, float(sample_params[op]))
        torch.testing.assert_close(result / 255, expected, rtol=0, atol=1e-5)


class BytesMoved(TorchDispatchMode):
    """Adds up the bytes of every operator's tensor inputs and outputs (what each reads and writes)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (PyTorch's protocol)
        result = func(*args, **(kwargs or {}))
        tensors = [value for value in torch.utils._pytree.tree_leaves((args, kwargs, result))
                   if isinstance(value, torch.Tensor)]
        self.bytes += sum(tensor.numel() * tensor.element_size() for tensor in tensors)
        return result


def test_the_device_input_reads_and_writes_the_batch_at_most_four_times_once_compiled() -> None:
    """model_pixels (colour jitter, normalisation, float32, channels-last) as a GPU runs it, compiled by
    Inductor (its CPU backend here): the bytes its kernels read and write, in Inductor's own count, are at
    most 4 fp32 batches, and at least the uint8 batch read once and the fp32 batch written once. Eagerly,
    op by op, it is over 100. The compiled pixels are the eager ones to float rounding."""
    from torch._inductor import metrics

    from common.data.device_input import model_pixels

    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8, generator=generator)
    jitter = torch.stack([torch.cat([torch.rand(3, generator=generator) * 0.8 + 0.6,
                                     torch.randperm(4, generator=generator).float()]) for _ in range(8)])
    mean, std = torch.tensor([124.0, 116.0, 104.0]).view(1, 3, 1, 1), torch.tensor([58.0, 57.0, 57.0]).view(1, 3, 1, 1)
    batch_bytes = images.numel() * 4
    with BytesMoved() as eager_count:
        eager = model_pixels(images, jitter, mean, std, True)
    torch._logging.set_logs(inductor_metrics=True)  # Inductor counts its kernels' bytes only then
    try:
        metrics.reset()
        compiled = torch.compile(model_pixels)(images, jitter, mean, std, True)
        passes = metrics.num_bytes_accessed / batch_bytes
    finally:
        torch._logging.set_logs()
    assert eager_count.bytes / batch_bytes > 100
    assert 1.25 <= passes <= 4, f"{passes:.2f} passes over the fp32 batch"
    assert compiled.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)


# ---- workers ----------------------------------------------------------------------------------------


def test_workers_default_to_the_cores_slurm_or_the_machine_gives_each_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(32)))
    for variable in ("SLURM_CPUS_PER_TASK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    assert cpu_cores_per_rank() == 32
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun: the node's cores are shared by its ranks
    assert cpu_cores_per_rank() == 4
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "16")  # the job got 16 of the 32
    assert cpu_cores_per_rank() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert cpu_cores_per_rank() == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "6")  # srun, one task per rank: its own cores
    assert cpu_cores_per_rank() == 6
    sampler = ResumableDistributedSampler(4, shuffle=False, drop_last=False)
    assert make_loader(list(range(4)), sampler, 2, num_workers=-1, pin_memory=False).num_workers == 6
    assert make_loader(list(range(4)), sampler, 2, num_workers=0, pin_memory=False).num_workers == 0
