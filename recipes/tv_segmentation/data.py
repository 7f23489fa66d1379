"""Pascal VOC 2012 and COCO (VOC classes) segmentation data with joint image+mask augmentation.

Both datasets become a list of (image, mask) file pairs: VOC's ``SegmentationClass`` palette
PNGs, or the masks ``recipes/tv_segmentation/coco.py`` wrote once for COCO. Augmentation
follows torchvision's segmentation presets, done with albumentations so image and mask get
the same geometry: training resizes the shorter side to a random size in [0.5, 2.0] x 520,
flips, and crops 480 (padding the image with 0 and the mask with 255); evaluation resizes
the shorter side to 520 and keeps the aspect ratio, so batches of several images are padded.
Images leave the workers as uint8 and are normalised on the device (``common.data.images.Normalize``):
per-sample float conversion on the CPU cost more than the augmentation, and uint8 batches
cross to the GPU at a quarter of the size.
"""

from __future__ import annotations

import random
from pathlib import Path

import albumentations as A
import cv2
import numpy as np
import torch
from albumentations.pytorch import ToTensorV2
from PIL import Image
from torch.utils.data import Dataset

from common.data.encoded import EncodedImage, open_image
from common.errors import UserError
from recipes.tv_segmentation import coco
from recipes.tv_segmentation.config import DataConfig

IGNORE_INDEX = 255
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
MEAN_UINT8 = tuple(round(255 * value) for value in MEAN)  # pads evaluation batches: about 0 once normalised
VOC_CLASSES = (
    "background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
    "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor",
)


def class_names(num_classes: int) -> list[str]:
    """Pascal VOC's names when there are its 21 classes, else ``class_<i>``."""
    return list(VOC_CLASSES) if num_classes == len(VOC_CLASSES) else [f"class_{i}" for i in range(num_classes)]

cv2.setNumThreads(0)  # DataLoader workers already run in parallel


def voc_pairs(root: Path, split: str) -> list[tuple[Path, Path]]:
    """(JPEG, palette PNG) pairs of a VOC2012 ``ImageSets/Segmentation/<split>.txt``."""
    listing = root / "ImageSets" / "Segmentation" / f"{split}.txt"
    if not listing.is_file():
        raise UserError(f"{listing} not found: data.root must be a VOC2012 folder "
                        "(run `make prep-tv_segmentation` or set data.root)")
    names = listing.read_text().split()
    return [(root / "JPEGImages" / f"{name}.jpg", root / "SegmentationClass" / f"{name}.png") for name in names]


def coco_pairs(root: Path, split: str) -> list[tuple[Path, Path]]:
    """(JPEG, VOC-class mask) pairs of a COCO split converted by ``make prep-tv_segmentation``."""
    listing = coco.list_file(root, split)
    if not listing.is_file():
        raise UserError(f"{listing} not found: convert COCO first with "
                        "`make prep-tv_segmentation SOURCE=<coco folder>` or set data.root")
    stems = listing.read_text().split()
    return [(coco.image_folder(root, split) / f"{stem}.jpg", coco.masks_folder(root, split) / f"{stem}.png")
            for stem in stems]


def find_pairs(cfg: DataConfig, split: str) -> list[tuple[Path, Path]]:
    """The split's file pairs, checked to exist and to start with a readable image and mask."""
    root = Path(cfg.root)
    if not root.is_dir():
        raise UserError(f"data directory {root} does not exist: run `make prep-tv_segmentation` or set data.root")
    pairs = voc_pairs(root, split) if cfg.dataset == "voc" else coco_pairs(root, split)
    if not pairs:
        raise UserError(f"{root}: the {split} split lists no images")
    for image, mask in pairs:
        for path in (image, mask):
            if not path.is_file():
                raise UserError(f"{path} is listed in the {split} split but missing")
    read_pair(*pairs[0])
    return pairs


def read_pair(image_path: Path, mask_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """RGB ``[H, W, 3]`` and class indices ``[H, W]`` (uint8), checked to match."""
    try:
        with Image.open(image_path) as image:
            rgb = np.array(image.convert("RGB"))
        with Image.open(mask_path) as mask:
            if mask.mode not in ("P", "L"):
                raise UserError(f"{mask_path} is a mode {mask.mode} image; masks are palette (P) or grey (L) PNGs")
            labels = np.array(mask)
    except OSError as error:
        raise UserError(f"cannot read {image_path} or {mask_path}: {error}") from error
    if rgb.shape[:2] != labels.shape:
        raise UserError(f"{image_path} is {rgb.shape[1]}x{rgb.shape[0]} but its mask {mask_path} is "
                        f"{labels.shape[1]}x{labels.shape[0]}")
    return rgb, labels


def train_transform(cfg: DataConfig) -> A.Compose:
    sizes = list(range(int(cfg.min_scale * cfg.base_size), int(cfg.max_scale * cfg.base_size) + 1))
    return A.Compose([
        A.SmallestMaxSize(max_size=sizes, interpolation=cv2.INTER_LINEAR, mask_interpolation=cv2.INTER_NEAREST),
        A.HorizontalFlip(p=cfg.hflip_prob),
        A.PadIfNeeded(cfg.crop_size, cfg.crop_size, position="top_left", border_mode=cv2.BORDER_CONSTANT,
                      fill=0, fill_mask=IGNORE_INDEX),
        A.RandomCrop(cfg.crop_size, cfg.crop_size),
        ToTensorV2(),
    ])


def eval_transform(base_size: int) -> A.Compose:
    return A.Compose([
        A.SmallestMaxSize(max_size=base_size, interpolation=cv2.INTER_LINEAR,
                          mask_interpolation=cv2.INTER_NEAREST),
        ToTensorV2(),
    ])


class SegmentationDataset(Dataset):
    """Image (uint8 ``[3, H, W]``) and mask pairs through an albumentations pipeline.

    albumentations draws from its own generators, not the global ones, so with ``augment=True``
    each sample re-seeds them from Python's global generator: wrapped in
    :class:`common.data.loaders.PerSampleSeeded`, a sample's augmentation then depends only on
    (seed, epoch, index), and a resumed run sees exactly what an uninterrupted one saw.
    """

    def __init__(self, pairs: list[tuple[Path, Path]], transform: A.Compose, num_classes: int,
                 augment: bool) -> None:
        self.pairs = pairs
        self.transform = transform
        self.num_classes = num_classes
        self.augment = augment

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, mask = read_pair(*self.pairs[index])
        labels = np.unique(mask)
        if labels[labels != IGNORE_INDEX].max(initial=0) >= self.num_classes:
            raise UserError(f"{self.pairs[index][1]} holds class {labels[labels != IGNORE_INDEX].max()}, "
                            f"outside 0..{self.num_classes - 1} (and 255 for ignored pixels)")
        if self.augment:
            seed = random.getrandbits(64)
            self.transform.set_random_state(np.random.default_rng(seed), random.Random(seed))
        out = self.transform(image=image, mask=mask)
        return out["image"], out["mask"]


class EvalImage:
    """One encoded image file through the evaluation transform: uint8 ``[3, H, W]`` (``make predict``)."""

    def __init__(self, base_size: int) -> None:
        self.transform = eval_transform(base_size)

    def __call__(self, image: EncodedImage) -> torch.Tensor:
        return self.transform(image=np.array(open_image(image.data, image.name, "RGB")))["image"]


def pad_collate(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack images of different sizes at the top left of the largest: masks padded with 255 so
    the padding is never scored, images with the mean colour, which normalises to about 0 (what
    torchvision's ``collate_fn`` pads its normalised images with)."""
    height = max(image.shape[1] for image, _ in batch)
    width = max(image.shape[2] for image, _ in batch)
    images = torch.tensor(MEAN_UINT8, dtype=batch[0][0].dtype).view(1, 3, 1, 1).repeat(len(batch), 1, height, width)
    masks = torch.full((len(batch), height, width), IGNORE_INDEX, dtype=batch[0][1].dtype)
    for i, (image, mask) in enumerate(batch):
        images[i, :, : image.shape[1], : image.shape[2]] = image
        masks[i, : mask.shape[0], : mask.shape[1]] = mask
    return images, masks
