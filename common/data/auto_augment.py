"""torchvision's TrivialAugmentWide and RandAugment for a whole batch at once, on any device.

Why: torchvision's policies work image by image; on a GPU each affine or rotate op makes two blocking
host-to-device copies, so a batch costs dozens of host syncs and over a thousand kernel launches.

- :class:`BatchAutoAugment` draws every image's ops and magnitudes on the CPU from torch's global
  generator with torchvision's calls in its order (a seed gives torchvision's choices).
- Applying them: one host-to-device copy of the numbers, one ``grid_sample`` for every geometric op,
  each colour op once on the images that drew it; nothing is read back from the device.
- Each op uses torchvision's uint8 formulas, truncation and rounding in float32 whole numbers: the same
  distribution, at most a grey level apart where float rounding differs. Fill is 0, torchvision's default.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from common.errors import UserError

_Magnitudes = Callable[[int, int, int], torch.Tensor | None]  # (bins, height, width) -> magnitude of each bin
_ImageOps = list[tuple[str, float]]  # one image's ops and their magnitudes, in the order they apply

# torchvision's augmentation spaces (torchvision/transforms/v2/_auto_augment.py): each op's
# magnitudes and whether a magnitude is negated with probability 1/2. The order is torchvision's,
# which the draws depend on.
_TRIVIAL_AUGMENT_WIDE: dict[str, tuple[_Magnitudes, bool]] = {
    "Identity": (lambda bins, height, width: None, False),
    "ShearX": (lambda bins, height, width: torch.linspace(0.0, 0.99, bins), True),
    "ShearY": (lambda bins, height, width: torch.linspace(0.0, 0.99, bins), True),
    "TranslateX": (lambda bins, height, width: torch.linspace(0.0, 32.0, bins), True),
    "TranslateY": (lambda bins, height, width: torch.linspace(0.0, 32.0, bins), True),
    "Rotate": (lambda bins, height, width: torch.linspace(0.0, 135.0, bins), True),
    "Brightness": (lambda bins, height, width: torch.linspace(0.0, 0.99, bins), True),
    "Color": (lambda bins, height, width: torch.linspace(0.0, 0.99, bins), True),
    "Contrast": (lambda bins, height, width: torch.linspace(0.0, 0.99, bins), True),
    "Sharpness": (lambda bins, height, width: torch.linspace(0.0, 0.99, bins), True),
    "Posterize": (lambda bins, height, width: (8 - (torch.arange(bins) / ((bins - 1) / 6))).round().int(), False),
    "Solarize": (lambda bins, height, width: torch.linspace(1.0, 0.0, bins), False),
    "AutoContrast": (lambda bins, height, width: None, False),
    "Equalize": (lambda bins, height, width: None, False),
}
_RAND_AUGMENT: dict[str, tuple[_Magnitudes, bool]] = {
    "Identity": (lambda bins, height, width: None, False),
    "ShearX": (lambda bins, height, width: torch.linspace(0.0, 0.3, bins), True),
    "ShearY": (lambda bins, height, width: torch.linspace(0.0, 0.3, bins), True),
    "TranslateX": (lambda bins, height, width: torch.linspace(0.0, 150.0 / 331.0 * width, bins), True),
    "TranslateY": (lambda bins, height, width: torch.linspace(0.0, 150.0 / 331.0 * height, bins), True),
    "Rotate": (lambda bins, height, width: torch.linspace(0.0, 30.0, bins), True),
    "Brightness": (lambda bins, height, width: torch.linspace(0.0, 0.9, bins), True),
    "Color": (lambda bins, height, width: torch.linspace(0.0, 0.9, bins), True),
    "Contrast": (lambda bins, height, width: torch.linspace(0.0, 0.9, bins), True),
    "Sharpness": (lambda bins, height, width: torch.linspace(0.0, 0.9, bins), True),
    "Posterize": (lambda bins, height, width: (8 - (torch.arange(bins) / ((bins - 1) / 4))).round().int(), False),
    "Solarize": (lambda bins, height, width: torch.linspace(1.0, 0.0, bins), False),
    "AutoContrast": (lambda bins, height, width: None, False),
    "Equalize": (lambda bins, height, width: None, False),
}
_GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")  # one grid_sample for all of them
INTERPOLATIONS = ("nearest", "bilinear", "bicubic")  # grid_sample's modes
# Columns of the numbers sent to the device, a row per image in the order of the op groups: the
# sampling grid's matrix (6), the blend ratio and its complement, the posterize step, the solarize
# threshold, the image's index in the batch, and in row i the row of the batch's image i.
THETA, RATIO, COMPLEMENT, STEP, THRESHOLD, INDEX, ROW_OF = slice(0, 6), 6, 7, 8, 9, 10, 11
_GREY = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale weights


def _inverse_affine(name: str, magnitude: float, height: int, width: int) -> list[float]:
    """A geometric op's 2x3 matrix from output to input pixel coordinates (centred on the image).

    Follows torchvision's ``_get_inverse_affine_matrix`` step by step: under nearest sampling a last-bit
    difference on a half-pixel picks another pixel.
    """
    centre, angle, translate, shear = [0.0, 0.0], 0.0, [0.0, 0.0], [0.0, 0.0]
    if name in ("ShearX", "ShearY"):  # about the top-left corner
        centre = [-width * 0.5, -height * 0.5]
        shear[name == "ShearY"] = math.degrees(math.atan(magnitude))
    elif name in ("TranslateX", "TranslateY"):
        translate[name == "TranslateY"] = float(int(magnitude))
    else:  # Rotate: torchvision's rotate takes the angle modulo 360 and negates it
        angle = -(magnitude % 360)
    rotation, shear_x, shear_y = math.radians(angle), math.radians(shear[0]), math.radians(shear[1])
    cos_shear_y, tan_shear_x = math.cos(shear_y), math.tan(shear_x)
    a = math.cos(rotation - shear_y) / cos_shear_y
    b = -(a * tan_shear_x + math.sin(rotation))
    c = math.sin(rotation - shear_y) / cos_shear_y
    d = math.cos(rotation) - c * tan_shear_x
    matrix = [d, -b, 0.0, -c, a, 0.0]
    shift_x, shift_y = centre[0] + translate[0], centre[1] + translate[1]
    matrix[2] += matrix[0] * -shift_x + matrix[1] * -shift_y
    matrix[5] += matrix[3] * -shift_x + matrix[4] * -shift_y
    matrix[2] += centre[0]
    matrix[5] += centre[1]
    return matrix


class BatchAutoAugment:
    """TrivialAugmentWide or RandAugment of uint8 ``[B, 3, H, W]`` batches (see the module).

    - ``num_ops``: ops per image; ``magnitude``: a fixed bin (RandAugment) or None, drawn per op (TrivialAugment).
    - Raises ``ValueError`` for an unknown ``interpolation`` or a magnitude outside ``[0, num_bins)``.
    """

    def __init__(self, space: dict[str, tuple[_Magnitudes, bool]], num_ops: int, magnitude: int | None,
                 num_bins: int = 31, interpolation: str = "nearest") -> None:
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {', '.join(INTERPOLATIONS)}, not {interpolation!r}")
        if magnitude is not None and not 0 <= magnitude < num_bins:
            raise ValueError(f"magnitude must be in [0, {num_bins}), not {magnitude}")
        self.space = space
        self.names = tuple(space)
        self.num_ops = num_ops
        self.magnitude = magnitude  # None: drawn per op (TrivialAugment)
        self.num_bins = num_bins
        self.interpolation = interpolation

    @classmethod
    def trivial_augment_wide(cls, num_bins: int = 31, interpolation: str = "nearest") -> BatchAutoAugment:
        return cls(_TRIVIAL_AUGMENT_WIDE, 1, None, num_bins, interpolation)

    @classmethod
    def rand_augment(cls, num_ops: int = 2, magnitude: int = 9, num_bins: int = 31,
                     interpolation: str = "nearest") -> BatchAutoAugment:
        return cls(_RAND_AUGMENT, num_ops, magnitude, num_bins, interpolation)

    def __repr__(self) -> str:
        policy = "TrivialAugmentWide(" if self.magnitude is None else\
            f"RandAugment(num_ops={self.num_ops}, magnitude={self.magnitude}, "
        return (f"{type(self).__name__}: {policy}num_magnitude_bins={self.num_bins}, "
                f"interpolation={self.interpolation})")

    # ---- draws, on the CPU ------------------------------------------------------------------------

    def draw(self, height: int, width: int) -> _ImageOps:
        """One image's ops and magnitudes, from torch's global generator with torchvision's calls."""
        ops = []
        for _ in range(self.num_ops):
            name = self.names[int(torch.randint(len(self.names), ()))]
            magnitudes_of, signed = self.space[name]
            magnitudes = magnitudes_of(self.num_bins, height, width)
            magnitude = 0.0
            if magnitudes is not None:
                index = self.magnitude if self.magnitude is not None else int(torch.randint(self.num_bins, ()))
                magnitude = float(magnitudes[index])
                if signed and torch.rand(()) <= 0.5:
                    magnitude *= -1
            ops.append((name, magnitude))
        return ops

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        """One uint8 ``[3, H, W]`` image, drawn from the global generator (a DataLoader worker's path)."""
        return self.apply(image[None], [self.draw(*image.shape[-2:])])[0]

    # ---- the batch, on its device --------------------------------------------------------------------

    def apply(self, images: torch.Tensor, draws: Sequence[_ImageOps]) -> torch.Tensor:
        """uint8 ``[B, 3, H, W]`` with each image's drawn ops applied in order."""
        if len(draws) != len(images):
            raise ValueError(f"{len(draws)} draws for {len(images)} images")
        pixels = images.float()  # whole numbers 0-255 throughout, as torchvision's uint8 steps
        for position in range(self.num_ops):
            pixels = self.apply_ops(pixels, [draw[position] for draw in draws])
        return pixels.to(torch.uint8)

    def apply_ops(self, pixels: torch.Tensor, ops: list[tuple[str, float]]) -> torch.Tensor:
        """Apply ``ops[i]`` to image ``i``: grouped by op, each group changed, one gather puts them back.

        Every number the groups need comes in one host-to-device copy.
        """
        height, width = pixels.shape[-2:]
        groups: dict[str, list[int]] = {}
        for index, (name, _) in enumerate(ops):
            groups.setdefault("affine" if name in _GEOMETRIC else name, []).append(index)
        if set(groups) == {"Identity"}:
            return pixels
        order = [index for members in groups.values() for index in members]
        row_of = [0] * len(order)
        for row, index in enumerate(order):
            row_of[index] = row
        numbers = torch.tensor([self.op_numbers(*ops[index], height, width) + [float(index), float(row_of[row])]
                                for row, index in enumerate(order)], dtype=torch.float32)
        # torchvision's _affine_grid: the matrix in float32, transposed, over half the size (in float32)
        numbers[:, THETA] = (numbers[:, THETA].view(-1, 2, 3).transpose(1, 2)
                             / torch.tensor([0.5 * width, 0.5 * height])).reshape(-1, 6)
        if pixels.device.type == "cuda":
            numbers = numbers.pin_memory()
        numbers = numbers.to(pixels.device, non_blocking=True)
        changed, start = [], 0
        for group, members in groups.items():
            own = numbers[start : start + len(members)]
            start += len(members)
            changed.append(self.apply_group(group, pixels.index_select(0, own[:, INDEX].long()), own))
        return torch.cat(changed).index_select(0, numbers[:, ROW_OF].long())

    def op_numbers(self, name: str, magnitude: float, height: int, width: int) -> list[float]:
        """One row of the copy: the numbers an op needs, in double precision as torchvision computes them."""
        theta = _inverse_affine(name, magnitude, height, width) if name in _GEOMETRIC else [0.0] * 6
        ratio = 1.0 + magnitude  # Brightness, Color, Contrast, Sharpness
        step = 2.0 ** (8 - int(magnitude)) if name == "Posterize" else 1.0
        return [*theta, ratio, 1.0 - ratio, step, 255.0 * magnitude]

    def apply_group(self, group: str, pixels: torch.Tensor, numbers: torch.Tensor) -> torch.Tensor:
        per_image = numbers.view(-1, numbers.shape[1], 1, 1)
        ratio, complement = per_image[:, RATIO : RATIO + 1], per_image[:, COMPLEMENT : COMPLEMENT + 1]
        if group == "Identity":
            return pixels
        if group == "affine":
            return self.affine(pixels, numbers[:, THETA])
        if group == "Brightness":
            return pixels.mul(ratio).clamp_(0, 255).trunc_()
        if group == "Color":
            return _blend(pixels, grey(pixels).floor_(), ratio, complement)
        if group == "Contrast":
            mean = grey(pixels).floor_().mean(dim=(-3, -2, -1), keepdim=True)
            return _blend(pixels, mean, ratio, complement)
        if group == "Sharpness":
            return _sharpen(pixels, complement)
        if group == "Posterize":
            step = per_image[:, STEP : STEP + 1]
            return pixels.div(step).floor_().mul_(step)
        if group == "Solarize":
            return torch.where(pixels >= per_image[:, THRESHOLD : THRESHOLD + 1], 255 - pixels, pixels)
        if group == "AutoContrast":
            return autocontrast(pixels)
        if group == "Equalize":
            return equalize(pixels)
        raise ValueError(f"no batched implementation of {group}")

    def affine(self, pixels: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        """torchvision's affine and rotate (``_affine_grid``, ``_apply_grid_transform``, no fill), per image."""
        batch, _, height, width = pixels.shape
        base = torch.empty(1, height, width, 3, device=pixels.device)
        base[..., 0].copy_(torch.linspace((1.0 - width) * 0.5, (width - 1.0) * 0.5, width, device=pixels.device))
        base[..., 1].copy_(torch.linspace((1.0 - height) * 0.5, (height - 1.0) * 0.5, height,
                                          device=pixels.device).unsqueeze_(-1))
        base[..., 2].fill_(1)
        grid = base.view(1, height * width, 3).expand(batch, -1, -1).bmm(theta.reshape(batch, 3, 2))
        moved = F.grid_sample(pixels, grid.view(batch, height, width, 2), mode=self.interpolation,
                              padding_mode="zeros", align_corners=False)
        return moved.round_().clamp_(0, 255)


def batch_policy(policy: Any) -> BatchAutoAugment:
    """The batched equivalent of a torchvision (v2) TrivialAugmentWide or RandAugment.

    DataLoader workers keep torchvision's own, image by image: it is faster on uint8 on a CPU.
    """
    from torchvision.transforms import v2

    if isinstance(policy, BatchAutoAugment):
        return policy
    if isinstance(policy, (v2.TrivialAugmentWide, v2.RandAugment)) and policy.fill is None:
        interpolation = getattr(policy.interpolation, "value", policy.interpolation)  # an InterpolationMode or a str
        if isinstance(policy, v2.TrivialAugmentWide):
            return BatchAutoAugment.trivial_augment_wide(policy.num_magnitude_bins, interpolation)
        return BatchAutoAugment.rand_augment(policy.num_ops, policy.magnitude, policy.num_magnitude_bins, interpolation)
    raise UserError(f"data.decode=gpu runs the per-sample policy on whole batches on the device, which this project "
                    f"does for torchvision's TrivialAugmentWide and RandAugment (without fill), not {policy!r}: use "
                    f"data.decode=cpu")


def grey(pixels: torch.Tensor) -> torch.Tensor:
    """torchvision's ``rgb_to_grayscale`` in float: ``[B, 1, H, W]``."""
    red, green, blue = pixels.unbind(dim=-3)
    return red.mul(_GREY[0]).add_(green, alpha=_GREY[1]).add_(blue, alpha=_GREY[2]).unsqueeze(dim=-3)


def _blend(pixels: torch.Tensor, other: torch.Tensor, ratio: torch.Tensor, complement: torch.Tensor) -> torch.Tensor:
    """torchvision's ``_blend`` of uint8 images: ``pixels * ratio + other * (1 - ratio)``, truncated."""
    return torch.addcmul(pixels.mul(ratio), other, complement).clamp_(0, 255).trunc_()  # fused as add(alpha=)


def _sharpen(pixels: torch.Tensor, complement: torch.Tensor) -> torch.Tensor:
    """torchvision's ``adjust_sharpness`` of uint8 images, without its convolution (slower on a CPU).

    A blend with the image smoothed by ``[[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13`` (rounded), border kept.
    Sums of whole numbers are exact and a sum over 13 is never half-way, so the rounding is torchvision's.
    """
    height, width = pixels.shape[-2:]
    if height <= 2 or width <= 2:
        return pixels
    output = pixels.clone()
    inner = output[..., 1:-1, 1:-1]
    neighbourhood = F.avg_pool2d(pixels, 3, stride=1, divisor_override=1)  # the 3x3 sums
    smoothed = neighbourhood.add_(inner, alpha=4).div_(13).round_()
    inner.addcmul_(smoothed.sub_(inner), complement)
    return output.clamp_(0, 255).trunc_()


def autocontrast(pixels: torch.Tensor) -> torch.Tensor:
    """torchvision's ``autocontrast`` of uint8 images: each channel stretched to 0-255."""
    minimum = pixels.amin(dim=(-2, -1), keepdim=True)
    maximum = pixels.amax(dim=(-2, -1), keepdim=True)
    flat = maximum == minimum
    scale = torch.where(flat, 1.0, (maximum - minimum).mul_(1.0 / 255))
    return (pixels - torch.where(flat, 0.0, minimum)).div_(scale).clamp_(0, 255).trunc_()


def equalize(pixels: torch.Tensor) -> torch.Tensor:
    """torchvision's ``equalize`` of uint8 images (PIL's lookup table), each channel on its own.

    The cumulative histogram comes from sorting and ``searchsorted``: deterministic on CUDA."""
    values = pixels.flatten(start_dim=-2)  # [B, 3, H*W]
    cumulative = torch.searchsorted(values.sort(dim=-1).values.contiguous(),
                                    torch.arange(256.0, device=pixels.device).expand(*values.shape[:-1], 256)
                                    .contiguous(), right=True)  # pixels <= each level
    histogram = torch.diff(cumulative, dim=-1, prepend=torch.zeros_like(cumulative[..., :1]))
    last_level = cumulative.argmax(dim=-1, keepdim=True)  # the brightest level present
    step = (values.shape[-1] - histogram.gather(-1, last_level)).div(255, rounding_mode="floor")
    table = (cumulative[..., :-1] + step // 2).div(step.clamp(min=1), rounding_mode="floor").clamp_(0, 255)
    table = torch.cat([torch.zeros_like(table[..., :1]), table], dim=-1)
    equalized = table.gather(-1, values.long()).view_as(pixels).float()
    return torch.where((step != 0).unsqueeze(-1), equalized, pixels)
