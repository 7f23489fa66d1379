"""One encoded image as a source gives it, and its decoding by PIL: what a recipe's spec needs to read an
image file (``make predict``), kept apart from ``common.data.images`` so that a recipe whose training
reads no image files (fashion_mnist) does not import OpenCV and torchvision for it."""

from __future__ import annotations

import io
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from common.errors import UserError


class EncodedImage(NamedTuple):
    """One sample as a source gives it: the encoded file's bytes, what its header says and its label."""

    data: np.ndarray  # uint8, writable
    name: str  # what an error names: the file, or the shard set and the sample
    width: int
    height: int
    device_decodable: bool  # a three-component JPEG, which nvjpeg decodes
    label: Any


def open_image(data: np.ndarray, name: str, mode: str) -> Image.Image:
    """An encoded image decoded whole by PIL and converted to ``mode`` (``L``, ``RGB``); ``UserError`` naming
    ``name`` when it does not decode (truncated, not an image, over PIL's decompression-bomb limit)."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert(mode)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise UserError(f"{name} is not a readable image ({error})") from error


class FixedSizeImage:
    """One encoded image as uint8 ``[C, size, size]`` in PIL ``mode``: what a dataset stored at one small size
    holds (Fashion-MNIST's 28 px greys, CIFAR's 32 px colour); an image of another size is resized to it
    (bilinear, antialiased), as those datasets were made."""

    def __init__(self, mode: str, size: int) -> None:
        self.mode, self.size = mode, size

    def __call__(self, image: EncodedImage) -> torch.Tensor:
        pil = open_image(image.data, image.name, self.mode)
        if pil.size != (self.size, self.size):
            pil = pil.resize((self.size, self.size), Image.Resampling.BILINEAR)
        pixels = torch.from_numpy(np.array(pil))
        return pixels.unsqueeze(0) if pixels.ndim == 2 else pixels.permute(2, 0, 1).contiguous()
