"""The main process's side of the image pipeline: a batch of worker output to the model's input, on the device.

- ``data.decode=gpu``: nvjpeg decodes, ``roi_align`` crops and resizes, the per-sample policy runs
  batched (:func:`common.data.auto_augment.batch_policy`).
- Both paths: colour jitter, normalisation, dtype and memory format in one function
  (:func:`model_pixels`), compiled on a GPU into two passes over the uint8 batch; then batch
  augmentation. The next batch's copy to the device starts while the current one trains
  (:meth:`DeviceTrainInput.to_device`, which ``TrainingRun.steps`` runs one batch ahead).
- The workers' side (crop boxes, CPU decode, what the worker hands over): ``common/data/images.py``.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torchvision
from PIL import Image

from common.config import Decode
from common.data.auto_augment import batch_policy
from common.data.image_batches import Normalize
from common.data.images import TrainAugmentation, check_size, decode
from common.errors import UserError

_GREY_WEIGHTS = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale
BRIGHTNESS, CONTRAST, SATURATION, HUE = range(4)  # the ops of a colour jitter draw's order (hue: not drawn, a no-op)


def gpu_decode_unsupported(augmentation: TrainAugmentation) -> str | None:
    """Why ``data.decode=gpu`` cannot run ``augmentation`` (and the fix), or None when it can."""
    if augmentation.per_sample_takes_pil:
        return ("the per-sample augmentation runs on the device there, and this one (a timm policy) works on PIL "
                "images only: use data.decode=cpu, or a torchvision policy (ta_wide)")
    if augmentation.interpolation != "bilinear":
        return (f"the device resizes bilinearly (roi_align), not {augmentation.interpolation}: set "
                f"data.interpolation=bilinear or use data.decode=cpu")
    return None


class DeviceTrainInput:
    """A batch of :class:`TrainImages` samples to the model's input, on the device.

    - ``decode=gpu``: decoding, crop, flip and the per-sample policy here; then for both colour jitter,
      normalisation (``mean``, ``std``) and ``batch_augmentation`` (e.g. random erasing) on the batch.
    - ``decode`` must be resolved (not ``auto``: ``ValueError``).
    - ``channels_last``: the model's input in that memory format (``trainer.channels_last``), written so.
    - On a GPU :func:`model_pixels` is compiled (``torch.compile``) at the first batch, and again for a
      new batch size (a halved micro-batch).
    """

    def __init__(self, augmentation: TrainAugmentation, decode: Decode, mean: Sequence[float],
                 std: Sequence[float], device: torch.device,
                 batch_augmentation: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 channels_last: bool = False) -> None:
        self.augmentation = augmentation
        self.decode = Decode(decode)
        if self.decode == Decode.auto:
            raise ValueError("data.decode=auto is resolved first (common/data/decode_choice.py)")
        self.device = device
        self.normalize = Normalize(mean, std, device)
        self.batch_augmentation = batch_augmentation
        self.channels_last = channels_last
        self.model_pixels = torch.compile(model_pixels) if device.type == "cuda" else model_pixels
        self.decode_stream = torch.cuda.Stream(device) if self.decode == Decode.gpu and device.type == "cuda" else None
        if self.decode == Decode.gpu:
            unsupported = gpu_decode_unsupported(augmentation)
            if unsupported:
                raise UserError(f"data.decode=gpu: {unsupported}")
            self.check_the_decoder()
        self.device_policy = None  # the per-sample policy, run on the device (decode=gpu) for a whole batch
        if self.decode == Decode.gpu and augmentation.per_sample is not None:
            self.device_policy = batch_policy(augmentation.per_sample)

    def check_the_decoder(self) -> None:
        """Decode a tiny JPEG once: a torchvision without a device decoder fails at start-up with one line."""
        jpeg = io.BytesIO()
        Image.new("RGB", (8, 8)).save(jpeg, "JPEG")
        try:
            self.decode_on_device([torch.frombuffer(bytearray(jpeg.getvalue()), dtype=torch.uint8)])
        except torch.OutOfMemoryError:
            raise  # a full GPU, not a missing decoder
        except Exception as error:  # a removed decoder may raise anything from AttributeError to RuntimeError
            raise UserError(f"data.decode=gpu: torchvision {torchvision.__version__} cannot decode JPEGs on "
                            f"{self.device} ({str(error).splitlines()[0]}); use data.decode=cpu") from error

    def __call__(self, batch: dict[str, Any]) -> torch.Tensor:
        images = self.crops_on_device(batch) if self.decode == Decode.gpu else batch["image"]
        jitter = batch["jitter"].to(self.device, non_blocking=True) if "jitter" in batch else None
        images = self.model_pixels(images.to(self.device, non_blocking=True), jitter, self.normalize.mean,
                                   self.normalize.std, self.channels_last)
        return self.batch_augmentation(images) if self.batch_augmentation is not None else images

    def to_device(self, batch: tuple[dict[str, Any], torch.Tensor]) -> tuple[dict[str, Any], torch.Tensor]:
        """A loader batch (inputs, labels) with what this side reads on the device copied there
        (without waiting): the images (``decode=cpu``; nvjpeg reads file bytes from the host), the
        jitter and flip draws, the labels."""
        inputs, labels = batch
        moved = {key: value.to(self.device, non_blocking=True) for key, value in inputs.items()
                 if key in ("jitter", "flip") or (key == "image" and self.decode == Decode.cpu)}
        return type(inputs)({**inputs, **moved}), labels.to(self.device, non_blocking=True)

    def crops_on_device(self, batch: dict[str, Any]) -> torch.Tensor:
        """uint8 ``[B, 3, S, S]``: the batch decoded, cropped, resized, flipped and augmented."""
        pieces = batch["data"].split(batch["length"].tolist())
        images: list[torch.Tensor | None] = [None] * len(pieces)
        jpegs = []
        for i, (piece, shape) in enumerate(zip(pieces, batch["shape"].tolist())):
            if shape[0]:
                images[i] = piece.view(shape).to(self.device, non_blocking=True).permute(2, 0, 1)
            else:
                jpegs.append(i)
        sizes = batch["size"].tolist()
        for i, image in zip(jpegs, self.decode_jpegs([pieces[i] for i in jpegs], [batch["path"][i] for i in jpegs])):
            check_size(image.shape[1:], sizes[i][1], sizes[i][0], batch["path"][i])  # shapes are known on the host
            images[i] = image
        size = int(batch["output_size"][0])  # the batch's epoch's (data.progressive); a host tensor: no sync
        crops = self.resized_crops(images, batch["box"], size)
        crops = crops.round_().clamp_(0, 255).to(torch.uint8)  # the per-sample policy sees uint8, as on the CPU
        flips = batch["flip"].to(self.device, non_blocking=True).view(-1, 1, 1, 1)
        crops = torch.where(flips, crops.flip(-1), crops)
        if self.device_policy is not None:  # each sample's ops drawn from its seed, applied to the batch
            with torch.random.fork_rng(devices=[]):  # the policy draws from torch's CPU generator
                draws = []
                for seed in batch["seed"].tolist():
                    torch.default_generator.manual_seed(seed)
                    draws.append(self.device_policy.draw(size, size))
            crops = self.device_policy.apply(crops, draws)
        return crops

    def decode_jpegs(self, pieces: list[torch.Tensor], paths: list[str]) -> list[torch.Tensor]:
        """Decode a batch on the device; on failure one at a time: refused files on the CPU, undecodable ones named.

        Running out of memory is not a refused file: ``torch.OutOfMemoryError`` goes to the run
        (``trainer.out_of_memory``), as it would from the forward pass."""
        if not pieces:
            return []
        try:
            return self.decode_on_device(pieces)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            return [self.decode_one(piece, path) for piece, path in zip(pieces, paths)]

    def decode_one(self, piece: torch.Tensor, path: str) -> torch.Tensor:
        try:
            return self.decode_on_device([piece])[0]
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            pixels = decode(piece.numpy(), path)
            return torch.from_numpy(pixels).to(self.device).permute(2, 0, 1)

    def decode_on_device(self, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """Decode on the device, safe on every torchvision; no host sync.

        - Why a side stream: nvjpeg decodes on its own stream without waiting for work queued on ours,
          into memory the allocator may have just taken back from it (pytorch/vision#9606: gradients
          overwritten). The side stream waits for the training stream; each image is marked as used there.
        - torchvision 0.29 deprecates these decoders (#9622); TorchCodec, their successor, must keep this rule.
        """
        with warnings.catch_warnings():  # torchvision 0.29 deprecates its decoders for TorchCodec's
            warnings.simplefilter("ignore", DeprecationWarning)
            if self.decode_stream is None:
                return torchvision.io.decode_jpeg(pieces, mode=torchvision.io.ImageReadMode.RGB, device=self.device)
            training_stream = torch.cuda.current_stream(self.device)
            self.decode_stream.wait_stream(training_stream)
            with torch.cuda.stream(self.decode_stream):
                images = torchvision.io.decode_jpeg(pieces, mode=torchvision.io.ImageReadMode.RGB, device=self.device)
            training_stream.wait_stream(self.decode_stream)
        for image in images:
            image.record_stream(training_stream)  # freed: reused once the training stream's work on it is done
        return images

    def resized_crops(self, images: list[torch.Tensor], boxes: torch.Tensor, size: int) -> torch.Tensor:
        """float ``[B, 3, S, S]``: each image's box resized to ``size`` with ``roi_align`` (bilinear, averaged
        when shrinking).

        - Each image is cut to its box (plus a pixel of margin) in uint8 before the float conversion: a
          whole 12-megapixel photo in float32 is 146 MB. The boxes reach the device in one copy.
        - The kernel is called directly: under ``torch.use_deterministic_algorithms`` on CUDA,
          ``torchvision.ops.roi_align`` swaps in a Python version (compiled in the first step and host
          syncing, or eager with a ``[K, 3, S, S, H, W]`` intermediate); the kernel's forward is deterministic.
        """
        regions, rois = [], []
        for image, (top, left, height, width) in zip(images, boxes.tolist()):
            first_row, first_col = max(0, math.floor(top) - 1), max(0, math.floor(left) - 1)
            end_row = min(image.shape[1], math.ceil(top + height) + 1)
            end_col = min(image.shape[2], math.ceil(left + width) + 1)
            regions.append(image[:, first_row:end_row, first_col:end_col])
            left, top = left - first_col, top - first_row
            rois.append([0, left, top, left + width, top + height])  # image index, x1, y1, x2, y2
        rois = torch.tensor(rois)
        if self.device.type == "cuda":
            rois = rois.pin_memory()
        rois = rois.to(self.device, non_blocking=True)
        kernel = torch.ops.torchvision.roi_align  # (input, rois, spatial scale, height, width, sampling, aligned)
        return torch.cat([kernel(region[None].float(), rois[i : i + 1], 1.0, size, size, -1, True)
                          for i, region in enumerate(regions)])



def model_pixels(images: torch.Tensor, jitter: torch.Tensor | None, mean: torch.Tensor, std: torch.Tensor,
                 channels_last: bool) -> torch.Tensor:
    """uint8 ``[B, 3, S, S]`` on the device to the model's input: colour jitter (``jitter``: each sample's
    draw, or None), ``(x - mean) / std`` (on the 0-255 scale), float32, channels-last if asked.

    Written so that ``torch.compile`` fuses it into a reduction (the contrast op's means) and one
    elementwise pass, each reading the uint8 batch once: about 3 passes over the fp32 batch in all,
    counted in tests/test_images.py (eagerly it is about 135)."""
    images = images.float()
    if jitter is not None:
        images = colour_jitter(images, jitter)
    images = (images - mean) / std
    return images.contiguous(memory_format=torch.channels_last) if channels_last else images


def colour_jitter(images: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """torchvision's ColorJitter (brightness, contrast, saturation) on 0-255 float ``[B, 3, H, W]``,
    each sample with its own factors and order (``params``: ``common.data.images``' draw, ``[B, 7]``).

    - Each op is ``clamp(alpha * x + beta * grey(x) + gamma, 0, 255)`` per channel, with the sample's
      ``alpha``, ``beta``, ``gamma`` at that position (:func:`_jitter_coefficients`); each channel is a
      plane of its own, so a compiled chain reads its neighbours' values without writing them out.
    - Contrast blends with the mean grey of the image as the ops before it leave it: those means are
      computed first, from the input, over the ops before each sample's contrast.
    """
    channels = tuple(images[:, channel : channel + 1] for channel in range(3))
    order = params[:, 3:]
    contrast_at = (order == CONTRAST).int().argmax(1, keepdim=True)
    before_contrast = torch.where(torch.arange(4, device=params.device) < contrast_at, order, float(HUE))
    grey = _grey(_jitter_chain(channels, _jitter_coefficients(params, before_contrast, 0.0)))
    jittered = _jitter_chain(channels, _jitter_coefficients(params, order, grey.mean((2, 3), keepdim=True)))
    return torch.cat(jittered, 1)


def _grey(channels: Sequence[torch.Tensor]) -> torch.Tensor:
    red, green, blue = channels
    return red * _GREY_WEIGHTS[0] + green * _GREY_WEIGHTS[1] + blue * _GREY_WEIGHTS[2]


def _jitter_coefficients(params: torch.Tensor, order: torch.Tensor,
                         contrast_mean: torch.Tensor | float) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per position, each sample's ``(alpha, beta, gamma)``, ``[B, 1, 1, 1]`` each: brightness ``(b, 0, 0)``,
    contrast ``(c, 0, (1 - c) * mean)``, saturation ``(s, 1 - s, 0)``, anything else ``(1, 0, 0)``."""
    brightness, contrast, saturation = (params[:, i].view(-1, 1, 1, 1) for i in range(3))
    coefficients = []
    for position in range(4):
        op = order[:, position].view(-1, 1, 1, 1)
        alpha = torch.where(op == BRIGHTNESS, brightness,
                            torch.where(op == CONTRAST, contrast, torch.where(op == SATURATION, saturation, 1.0)))
        beta = torch.where(op == SATURATION, 1 - saturation, 0.0)
        gamma = torch.where(op == CONTRAST, (1 - contrast) * contrast_mean, 0.0)
        coefficients.append((alpha, beta, gamma))
    return coefficients


def _jitter_chain(channels: Sequence[torch.Tensor],
                  coefficients: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    for alpha, beta, gamma in coefficients:
        grey = _grey(channels)
        channels = tuple((alpha * channel + beta * grey + gamma).clamp(0, 255) for channel in channels)
    return channels
