"""Image input pipelines that keep a GPU fed: JPEG files to normalised batches on the device.

- Sources of bytes and sizes: files by path (:class:`PathImages`), a saved file list
  (``common/data/file_index.py``) or shards (``common/data/shards.py``).
- ``data.decode=cpu``: the worker draws the crop box, decodes at the smallest DCT scale that keeps the
  box at least the output size, then crops, resizes and augments on uint8.
- ``data.decode=gpu``: the worker only reads the bytes and makes the same draws; the main process
  decodes with nvjpeg and crops with ``roi_align`` (the worker decodes what nvjpeg cannot).
- The float work, once per batch on the device: ``common/data/device_input.py``.
- Every draw is seeded by :class:`common.data.loaders.PerSampleSeeded` from (seed, epoch, index), in
  timm's and torchvision's order: a resume sees the same images.
- Figures and limits: docs/data.md, "Decoding: feeding a GPU from JPEG files".
"""

from __future__ import annotations

import io
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import cv2
import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset, default_collate
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as tvf

from common.config import Decode
from common.data.encoded import EncodedImage
from common.errors import UserError

cv2.setNumThreads(0)  # DataLoader workers already run in parallel

INTERPOLATIONS = {"bilinear": InterpolationMode.BILINEAR, "bicubic": InterpolationMode.BICUBIC}
_DCT_SCALES = (1, 2, 4, 8)  # the reductions libjpeg decodes directly
_DECODE_FLAGS = {  # 3-channel output at 1/reduction of the size; EXIF rotation ignored, as PIL, timm and nvjpeg do
    reduction: flag | cv2.IMREAD_IGNORE_ORIENTATION
    for reduction, flag in ((1, cv2.IMREAD_COLOR), (2, cv2.IMREAD_REDUCED_COLOR_2), (4, cv2.IMREAD_REDUCED_COLOR_4),
                            (8, cv2.IMREAD_REDUCED_COLOR_8))
}


class CropBox(NamedTuple):
    """A crop in source pixels: rows ``top:top+height``, columns ``left:left+width``."""

    top: float
    left: float
    height: float
    width: float

    def scaled(self, sx: float, sy: float) -> CropBox:
        """The same region in an image decoded at ``sx`` x ``sy`` of the size (fractional pixels)."""
        return CropBox(self.top * sy, self.left * sx, self.height * sy, self.width * sx)


# ---- worker side: files, headers, decoding, crops ------------------------------------------------


def read_file(path: str) -> np.ndarray:
    """A file's bytes as a writable uint8 array (cv2, PIL and torch read it without a copy)."""
    try:
        return np.fromfile(path, dtype=np.uint8)
    except OSError as error:
        raise UserError(f"{path} cannot be read ({error})") from error


def read_header(data: np.ndarray | str, path: str) -> tuple[int, int, bool]:
    """Width, height and whether nvjpeg can take it (a three-component JPEG), from the header alone.

    - ``data``: the file's bytes, or its path (then only its first few KB are read).
    - Raises ``UserError`` naming ``path`` when it is not a readable image.
    """
    try:
        with Image.open(data if isinstance(data, str) else io.BytesIO(data)) as image:
            return image.width, image.height, image.format == "JPEG" and image.mode == "RGB"
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise UserError(f"{path} is not a readable image ({error})") from error


class PathImages(Dataset):
    """Image files by path, each header read from the file's bytes (a saved list is ``IndexedFiles``)."""

    def __init__(self, paths: Sequence[str], labels: Sequence[Any]) -> None:
        self.paths = paths
        self.labels = labels

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> EncodedImage:
        path = self.paths[index]
        data = read_file(path)
        return EncodedImage(data, path, *read_header(data, path), self.labels[index])


def decode(data: np.ndarray, path: str, reduction: int = 1) -> np.ndarray:
    """RGB uint8 ``[H, W, 3]`` of an encoded image; greyscale and CMYK come out as RGB, as PIL's convert gives.

    ``reduction``: 2, 4 or 8 decodes directly at that fraction of the size (libjpeg's DCT scaling)."""
    pixels = cv2.imdecode(data, _DECODE_FLAGS[reduction])
    if pixels is None:
        raise UserError(f"{path} is not a readable image (it does not decode)")
    return cv2.cvtColor(pixels, cv2.COLOR_BGR2RGB, dst=pixels)  # OpenCV decodes to BGR


def check_size(decoded: Sequence[int], width: int, height: int, name: str, reduction: int = 1) -> None:
    """Raise ``UserError`` unless an image decoded at ``1/reduction`` is the ``width`` x ``height`` listed.

    A file changed in place after its list was saved would otherwise be cropped where it has no pixels.
    """
    if (decoded[0], decoded[1]) != (math.ceil(height / reduction), math.ceil(width / reduction)):
        raise UserError(f"{name} is about {decoded[1] * reduction}x{decoded[0] * reduction} pixels, but its file list "
                        f"says {width}x{height}: the file changed after the list was saved; list the files again "
                        f"with data.rebuild_index=true")


def dct_reduction(box: CropBox, size: int) -> int:
    """The largest DCT scale that keeps both sides of ``box`` at least ``size`` pixels."""
    reduction = 1
    while reduction < _DCT_SCALES[-1] and min(box.height, box.width) >= 2 * reduction * size:
        reduction *= 2
    return reduction


def random_resized_crop(width: int, height: int, scale: tuple[float, float],
                        ratio: tuple[float, float]) -> CropBox:
    """timm's RandomResizedCropAndInterpolation box (torchvision's algorithm), drawn from Python's generator.

    Draws in timm's order: an area fraction in ``scale``, a log-uniform aspect ratio in ``ratio``, 10 tries, then
    the whole image clipped to ``ratio``."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = random.uniform(*scale) * area
        aspect = math.exp(random.uniform(*log_ratio))
        crop_width = int(round(math.sqrt(target_area * aspect)))
        crop_height = int(round(math.sqrt(target_area / aspect)))
        if 0 < crop_width <= width and 0 < crop_height <= height:
            return CropBox(random.randint(0, height - crop_height), random.randint(0, width - crop_width),
                           crop_height, crop_width)
    if width / height < min(ratio):
        crop_width, crop_height = width, int(round(width / min(ratio)))
    elif width / height > max(ratio):
        crop_width, crop_height = int(round(height * max(ratio))), height
    else:
        crop_width, crop_height = width, height
    return CropBox((height - crop_height) // 2, (width - crop_width) // 2, crop_height, crop_width)


def _crop_resize(pixels: np.ndarray, box: CropBox, size: int, interpolation: str) -> torch.Tensor:
    """uint8 ``[3, size, size]``: ``box`` of ``[H, W, 3]`` pixels resized with antialiasing, as PIL does.

    A whole-pixel box takes torch's uint8 kernels (faster: benchmarks/RESULTS.md, issue 36 section); a
    fractional box (a reduced-scale decode) takes PIL's, which resamples exactly that region.
    """
    if all(float(edge).is_integer() for edge in box):
        top, left, height, width = (int(edge) for edge in box)
        region = torch.from_numpy(pixels[top : top + height, left : left + width]).permute(2, 0, 1)
        return tvf.resize(region, [size, size], interpolation=INTERPOLATIONS[interpolation], antialias=True)
    resample = Image.BILINEAR if interpolation == "bilinear" else Image.BICUBIC
    resized = Image.fromarray(pixels).resize((size, size), resample,
                                             box=(box.left, box.top, box.left + box.width, box.top + box.height))
    return torch.from_numpy(np.array(resized)).permute(2, 0, 1)


def _draw_colour_jitter(strength: float) -> torch.Tensor:
    """``[brightness, contrast, saturation, order of 4]`` drawn as torchvision's ``ColorJitter.get_params`` (no hue)."""
    order = torch.randperm(4)
    low, high = max(0.0, 1 - strength), 1 + strength
    factors = [float(torch.empty(1).uniform_(low, high)) for _ in range(3)]
    return torch.tensor([*factors, *order.tolist()], dtype=torch.float32)


# ---- the per-sample settings and draws ---------------------------------------------------------


@dataclass(frozen=True)
class TrainAugmentation:
    """A recipe's per-sample training augmentation: random-resized crop, flip, colour jitter, a policy.

    Colour jitter is applied on the device; raises ``UserError`` for an unknown ``interpolation``."""

    size: int
    scale: tuple[float, float] = (0.08, 1.0)  # crop area, as a fraction of the image
    ratio: tuple[float, float] = (3 / 4, 4 / 3)  # crop aspect ratio
    hflip: float = 0.5
    interpolation: str = "bilinear"  # bilinear | bicubic | random (one of the two per sample, as timm)
    colour_jitter: float = 0.0  # brightness, contrast and saturation strength (timm's scalar color_jitter)
    per_sample: Callable[[Any], Any] | None = None  # RandAugment, TrivialAugment...: uint8 [3, S, S] (or PIL)
    per_sample_takes_pil: bool = False  # timm's policies work on PIL images (CPU decoding only)

    def __post_init__(self) -> None:
        if self.interpolation not in (*INTERPOLATIONS, "random"):
            raise UserError(f"data.interpolation must be bilinear, bicubic or random, not {self.interpolation!r}")

    def draw(self, width: int, height: int, decode: Decode) -> Draw:
        """Every random choice for one sample of a ``width`` x ``height`` image."""
        box = random_resized_crop(width, height, self.scale, self.ratio)
        interpolation = random.choice(tuple(INTERPOLATIONS)) if self.interpolation == "random" else self.interpolation
        flip = self.hflip > 0 and bool(torch.rand(1) < self.hflip)
        jitter = _draw_colour_jitter(self.colour_jitter) if self.colour_jitter > 0 else None
        # On the device the policy runs after the batch is decoded: its draws get a seed of their own.
        seed = random.getrandbits(63) if decode == Decode.gpu and self.per_sample is not None else 0
        return Draw(box, interpolation, flip, jitter, seed)


class Draw(NamedTuple):
    box: CropBox
    interpolation: str
    flip: bool
    jitter: torch.Tensor | None
    seed: int  # seeds the per-sample policy when it runs on the device


class TrainImages(Dataset):
    """``(sample, label)`` for training, made in a DataLoader worker (wrap in PerSampleSeeded).

    - ``images``: :class:`PathImages`, ``IndexedFiles`` or ``ShardImages``; the draws depend on the
      sample's index and size alone, so every source gives the same batches.
    - ``decode=cpu``: the sample is ``{"image": uint8 [3, S, S]}`` (plus ``"jitter"``); ``decode=gpu``:
      the file's bytes and the draws, for :class:`DeviceTrainInput`.
    """

    def __init__(self, images: Dataset, augmentation: TrainAugmentation, decode: Decode,
                 draft_decode: bool = True) -> None:
        self.images = images
        self.augmentation = augmentation
        self.decode = Decode(decode)
        if self.decode == Decode.auto:
            raise ValueError("data.decode=auto is resolved first (common/data/decode_choice.py)")
        self.draft_decode = draft_decode

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[dict[str, Any], Any]:
        image = self.images[index]
        draw = self.augmentation.draw(image.width, image.height, self.decode)
        if self.decode == Decode.gpu:
            sample = self._for_the_device(image, draw)
        else:
            sample = {"image": self._crop_here(image, draw)}
        if draw.jitter is not None:
            sample["jitter"] = draw.jitter
        return sample, image.label

    def _decode_for(self, box: CropBox, image: EncodedImage) -> tuple[np.ndarray, CropBox]:
        """The pixels, at a reduced scale where the box allows, and the box in their coordinates."""
        reduction = dct_reduction(box, self.augmentation.size) if self.draft_decode else 1
        pixels = decode(image.data, image.name, reduction)
        check_size(pixels.shape, image.width, image.height, image.name, reduction)
        if reduction == 1:
            return pixels, box
        return pixels, box.scaled(pixels.shape[1] / image.width, pixels.shape[0] / image.height)

    def _crop_here(self, image: EncodedImage, draw: Draw) -> torch.Tensor:
        pixels, box = self._decode_for(draw.box, image)
        cropped = _crop_resize(pixels, box, self.augmentation.size, draw.interpolation)
        if draw.flip:
            cropped = cropped.flip(-1)
        policy = self.augmentation.per_sample
        if policy is None:
            return cropped
        if self.augmentation.per_sample_takes_pil:
            augmented = policy(Image.fromarray(cropped.permute(1, 2, 0).numpy()))
            return torch.from_numpy(np.array(augmented)).permute(2, 0, 1)
        return policy(cropped)

    def _for_the_device(self, image: EncodedImage, draw: Draw) -> dict[str, Any]:
        """The bytes of a JPEG nvjpeg decodes, else the pixels decoded here (box in their coordinates)."""
        data, box, shape = image.data, draw.box, (0, 0, 0)
        if not image.device_decodable:
            pixels, box = self._decode_for(draw.box, image)
            data, shape = pixels.reshape(-1), pixels.shape
        return {
            "data": torch.from_numpy(data),
            "shape": torch.tensor(shape),
            "size": torch.tensor((image.height, image.width)),
            "box": torch.tensor(box, dtype=torch.float32),
            "flip": torch.tensor(draw.flip),
            "seed": torch.tensor(draw.seed),
            "output_size": torch.tensor(self.augmentation.size),  # the crop's, which can vary by epoch
            "path": image.name,
        }


class ResizedImages(Dataset):
    """``(uint8 [3, S, S], label)``: whole images resized to ``size`` x ``size`` for evaluation, from any source."""

    def __init__(self, images: Dataset, size: int, draft_decode: bool = True) -> None:
        self.images = images
        self.size = size
        self.draft_decode = draft_decode

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, Any]:
        image = self.images[index]
        return self.decoded(image), image.label

    def decoded(self, image: EncodedImage) -> torch.Tensor:
        """One image, whole, resized to ``size`` x ``size`` (``make predict`` calls this alone)."""
        whole = CropBox(0, 0, image.height, image.width)
        reduction = dct_reduction(whole, self.size) if self.draft_decode else 1
        pixels = decode(image.data, image.name, reduction)
        check_size(pixels.shape, image.width, image.height, image.name, reduction)
        box = CropBox(0, 0, *pixels.shape[:2])
        return _crop_resize(pixels, box, self.size, "bilinear")


class PackedFiles(dict):
    """A ``data.decode=gpu`` batch: all file bytes end to end in ``data``, their lengths in ``length``."""

    def split_samples(self, size: int) -> list[PackedFiles]:
        """Micro-batches of ``size`` samples (``common.data.loaders.split_micro_batch``)."""
        from common.data.loaders import split_micro_batch

        lengths = self["length"].split(size)
        data = self["data"].split([int(piece.sum()) for piece in lengths])  # host tensors: no device sync
        rest = {key: split_micro_batch(value, size) for key, value in self.items() if key not in ("data", "length")}
        return [PackedFiles(data=data[i], length=lengths[i], **{key: value[i] for key, value in rest.items()})
                for i in range(len(lengths))]


def collate_train(batch: list[tuple[dict[str, Any], Any]]) -> tuple[dict[str, Any], Any]:
    """Stack a batch of :class:`TrainImages` samples; file bytes are joined into one tensor (one shared block)."""
    samples, labels = zip(*batch)
    if "data" not in samples[0]:
        return default_collate(list(samples)), default_collate(list(labels))
    fixed = PackedFiles(default_collate([{key: value for key, value in sample.items() if key != "data"}
                                         for sample in samples]))
    pieces = [sample["data"] for sample in samples]
    fixed["data"] = torch.cat(pieces)
    fixed["length"] = torch.tensor([len(piece) for piece in pieces])
    return fixed, default_collate(list(labels))
