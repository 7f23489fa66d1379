"""Predict on new images with a trained run or an export: a CSV row per image (``make predict``).

    make predict RUN=<run dir | checkpoint folder | checkpoint | export folder> INPUT=<folder | list.txt | image>
                 [OUT=<folder>] [WHICH=latest|best|<name>] [TOPK=5] [ARGS=...]
    python -m common.after_training.predict RUN INPUT [--out DIR] [--which W] [--topk K] [key=value ...]

- The model is the checkpoint's (its EMA where the run keeps one, as ``make export`` takes), or the export's,
  rebuilt from the folder alone; the input goes through the recipe's own evaluation transform
  (``RecipeSpec.predict_input``), described by the export's ``metadata.json`` or, for a run, by what its export
  would write (so a run's data must be where its config says: the classes are read from it).
- ``<out>/predictions.csv``: the image's path, then for each level the model predicts (``class``; fungitastic's
  taxonomic levels) the top-k class names and probabilities; tv_segmentation writes a palette PNG mask per
  image under ``<out>/masks/`` and each class's share of the pixels instead.
- A file that is not a readable image is named on stderr and in the ``error`` column, and the rest are
  predicted; exit 2 when none could be.
- docs/after-training.md.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS
from tqdm import tqdm

from common.after_training.export import is_export, load_export
from common.after_training.trained import LATEST, load_model, open_run, read_state
from common.data.encoded import EncodedImage
from common.data.images import PathImages
from common.entry import distributed_process, exit_after, fail, user_message
from common.errors import UserError
from common.pytorch.distributed import on_device, resolve_device
from common.pytorch.precision import autocast
from common.recipes import PredictInput, RecipeSpec, load_recipe

CSV_FILE = "predictions.csv"
MASKS = "masks"
LIST_SUFFIX = ".txt"  # INPUT=<list.txt>: one image path a line, relative to the list's folder or absolute


# ---- input ------------------------------------------------------------------------------------


def image_paths(source: str | Path) -> list[Path]:
    """The images ``INPUT`` names: a folder's image files (recursively, sorted), a list file's, or one image."""
    path = Path(source)
    if path.is_dir():
        paths = sorted(p for p in path.rglob("*") if p.is_file() and p.name.lower().endswith(IMG_EXTENSIONS))
        if not paths:
            raise UserError(f"INPUT={path} holds no image files ({', '.join(IMG_EXTENSIONS)})")
        return paths
    if not path.is_file():
        raise UserError(f"INPUT={path} does not exist: name a folder of images, a {LIST_SUFFIX} list of them or one")
    if path.suffix.lower() == LIST_SUFFIX:
        paths = [path.parent / line.strip() for line in path.read_text().splitlines() if line.strip()]
        if not paths:
            raise UserError(f"INPUT={path} lists no images: write one image path a line")
        return paths
    if not path.name.lower().endswith(IMG_EXTENSIONS):
        raise UserError(f"INPUT={path} is neither an image ({', '.join(IMG_EXTENSIONS)}) nor a {LIST_SUFFIX} list")
    return [path]


class _Images(Dataset):
    """``(index, uint8 image or None, (height, width) of the file, error)`` per path: a file that does not read as
    an image gives its one-line error instead of stopping the others."""

    def __init__(self, paths: list[Path], decode: Callable[[EncodedImage], torch.Tensor]) -> None:
        self.files = PathImages([str(path) for path in paths], [None] * len(paths))
        self.decode = decode

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor | None, tuple[int, int] | None, str]:
        try:
            image = self.files[index]
            return index, self.decode(image), (image.height, image.width), ""
        except UserError as error:
            return index, None, None, user_message(error)


class _Collate:
    """A batch of ``_Images`` items: ``(indices, images stacked or None, sizes, {index: error})``, each size the
    file's and the decoded image's ``(height, width)``; images of different sizes padded at the bottom right
    with ``pad``."""

    def __init__(self, pad: tuple[int, ...] | None) -> None:
        self.pad = pad

    def __call__(self, items: list[tuple]) -> tuple[list[int], torch.Tensor | None, list, dict[int, str]]:
        errors = {index: error for index, _, _, error in items if error}
        good = [(index, image, size) for index, image, size, error in items if not error]
        if not good:
            return [], None, [], errors
        images = [image for _, image, _ in good]
        if self.pad is None or len({image.shape for image in images}) == 1:
            batch = torch.stack(images)
        else:
            height, width = max(image.shape[1] for image in images), max(image.shape[2] for image in images)
            batch = torch.tensor(self.pad, dtype=images[0].dtype).view(1, -1, 1, 1).repeat(len(images), 1,
                                                                                              height, width)
            for row, image in zip(batch, images):
                row[:, : image.shape[1], : image.shape[2]] = image
        sizes = [(size, (image.shape[1], image.shape[2])) for _, image, size in good]
        return [index for index, _, _ in good], batch, sizes, errors


# ---- the model --------------------------------------------------------------------------------


@dataclass
class _Loaded:
    """A model ready to predict and what predicting with it needs."""

    spec: RecipeSpec
    model: torch.nn.Module  # in eval mode, on ``device``
    metadata: dict[str, Any]  # the export's metadata.json, or what a run's export would write
    device: torch.device
    precision: str
    channels_last: bool
    described: str  # which weights, for the report
    out: Path  # where the predictions go unless OUT= says


@contextlib.contextmanager
def _opened_run(source: str, which: str, overrides: list[str], device: str) -> Iterator[_Loaded]:
    """A run's checkpoint in the run's own process set-up (FSDP as trained), its precision and layout."""
    run = open_run(source, which, [*overrides, *([f"device={device}"] if device else [])])
    spec = load_recipe(run.recipe)
    with distributed_process(run.cfg, **spec.process_group(run.cfg)) as dist_info:
        if dist_info.world_size != 1:
            raise UserError("make predict runs in one process: start it without torchrun (NPROC=1)")
        model = spec.model_as_trained(run.cfg, dist_info, False)
        state = read_state(run.checkpoint)
        ema = state.get("extra", {}).get("ema")
        if ema is not None:  # what make export takes: the EMA where the run keeps one
            model.load_state_dict(ema)
        else:
            load_model(model, run.checkpoint, state)
        weights = "ema" if ema is not None else "model"
        described = f"{weights} weights of {run.checkpoint} (step {run.manifest['step']})"
        yield _Loaded(spec, model.eval(), spec.export_metadata(run.cfg), dist_info.device, run.cfg.trainer.precision,
                      run.cfg.trainer.channels_last, described, run.run_dir / f"predict-{run.which}")


@contextlib.contextmanager
def _opened_export(folder: Path, device: str, precision: str) -> Iterator[_Loaded]:
    """An export folder's model on ``device`` (default: a GPU where there is one), in ``precision``."""
    model, metadata = load_export(folder)
    on = resolve_device(device or "auto")
    yield _Loaded(load_recipe(metadata["recipe"]), on_device(model, on, False), metadata, on, precision, False,
                  f"{metadata['weights']} weights of {folder}", folder / "predict")


def _predict_input(loaded: _Loaded, source: str) -> PredictInput:
    try:
        return loaded.spec.predict_input(loaded.metadata, loaded.device)
    except KeyError as error:
        raise UserError(f"the metadata of {source} has no {error} (written before make predict read it): "
                        f"export the run again") from error


# ---- output -----------------------------------------------------------------------------------


def _classification_rows(scores: dict[str, torch.Tensor], classes: dict[str, list[str]], topk: int
                         ) -> list[dict[str, Any]]:
    """Per image: ``<level>_<i>`` the i-th most probable class's name and ``<level>_prob_<i>`` its probability."""
    rows: list[dict[str, Any]] = [{} for _ in range(len(next(iter(scores.values()))))]
    for level, logits in scores.items():
        names = classes[level]
        probabilities, labels = logits.float().softmax(1).topk(min(topk, logits.shape[1]), dim=1)
        for row, probs, picks in zip(rows, probabilities.tolist(), labels.tolist()):
            for rank, (probability, label) in enumerate(zip(probs, picks), start=1):
                row[f"{level}_{rank}"] = names[label] if names[label] is not None else str(label)
                row[f"{level}_prob_{rank}"] = f"{probability:.6f}"
    return rows


def _mask_rows(scores: torch.Tensor, sizes: list[tuple[tuple[int, int], tuple[int, int]]],
               classes: list[str], palette: list[int], names: list[Path], out: Path) -> list[dict[str, Any]]:
    """Per image: its mask (each pixel's most probable class, at the file's own size) as a palette PNG under
    ``out``, and each class's share of its pixels."""
    rows = []
    for image_scores, ((height, width), (in_height, in_width)), name in zip(scores, sizes, names):
        cropped = image_scores[:, :in_height, :in_width].float().unsqueeze(0)  # the padding left out
        mask = F.interpolate(cropped, size=(height, width), mode="bilinear", align_corners=False)[0].argmax(0)
        shares = (torch.bincount(mask.flatten(), minlength=len(classes)).double() / mask.numel()).tolist()
        picture = Image.fromarray(mask.to(torch.uint8).cpu().numpy())
        picture.putpalette(palette)  # mode L becomes P, the class indices kept as palette indices
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        picture.save(path)
        rows.append({"mask": str(path.relative_to(out.parent)),
                     **{f"share_{cls}": f"{share:.6f}" for cls, share in zip(classes, shares)}})
    return rows


def _mask_names(paths: list[Path]) -> list[Path]:
    """Each image's mask file, relative to ``masks/``: its path below the images' common folder, as ``.png``."""
    base = Path(os.path.commonpath([path.resolve().parent for path in paths]))
    return [path.resolve().relative_to(base).with_suffix(".png") for path in paths]


def predict(source: str, inputs: str, out: str = "", which: str = LATEST, topk: int = 5, batch_size: int = 32,
            workers: int = 4, device: str = "", precision: str = "", overrides: Sequence[str] = ()) -> Path:
    """Predict every image ``inputs`` names with the model ``source`` names (a run or an export); the CSV written.

    ``device``, ``precision``: a run's own (its config) unless given; an export's: a GPU where there is one, fp32.
    """
    if topk < 1:
        raise UserError(f"TOPK={topk}: ask for 1 or more classes per image")
    paths = image_paths(inputs)
    folder = Path(source)
    if is_export(folder):
        if which != LATEST or overrides:
            raise UserError(f"{folder} is an export: WHICH= and key=value settings apply to a run only")
        opened = _opened_export(folder, device, precision or "fp32")
    else:
        if precision:
            overrides = [*overrides, f"trainer.precision={precision}"]
        opened = _opened_run(source, which, list(overrides), device)
    with opened as loaded:
        return _write(paths, loaded, _predict_input(loaded, source), Path(out) if out else loaded.out, topk,
                      batch_size, workers)


def _write(paths: list[Path], loaded: _Loaded, given: PredictInput, out: Path, topk: int, batch_size: int,
           workers: int) -> Path:
    """Predict ``paths`` in batches, writing ``out/predictions.csv`` (and masks); the CSV's path."""
    loader = DataLoader(_Images(paths, given.decode), batch_size=batch_size, num_workers=workers,
                        collate_fn=_Collate(given.pad), pin_memory=loaded.device.type == "cuda")
    masks = _mask_names(paths) if given.palette else []
    rows: list[dict[str, Any]] = [{} for _ in paths]
    print(f"predicting {len(paths)} images with the {loaded.described} on {loaded.device}", flush=True)
    with torch.no_grad():
        for indices, images, sizes, errors in tqdm(loader, desc=f"predict {len(paths)} images", unit="batch",
                                                   file=sys.stderr):
            for index, error in errors.items():
                tqdm.write(f"error: {error}", file=sys.stderr)  # on its own line, above the progress bar
                rows[index]["error"] = error
            if images is None:
                continue
            x = given.prepare(images)
            if loaded.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            with autocast(loaded.device, loaded.precision):
                scores = given.scores(loaded.model(x))
            if given.palette:
                ((level, per_pixel),) = scores.items()
                found = _mask_rows(per_pixel, sizes, given.classes[level], given.palette,
                                   [masks[index] for index in indices], out / MASKS)
            else:
                found = _classification_rows(scores, given.classes, topk)
            for index, row in zip(indices, found):
                rows[index] |= row
    if all("error" in row for row in rows):
        raise UserError(f"none of the {len(paths)} images of INPUT could be read: each is named above")
    columns = ["path", *dict.fromkeys(key for row in rows for key in row if key != "error"), "error"]
    out.mkdir(parents=True, exist_ok=True)
    path = out / CSV_FILE
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, columns)
        writer.writeheader()
        for image, row in zip(paths, rows):
            writer.writerow({"path": str(image), **row})
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m common.after_training.predict", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a run directory, its checkpoint folder, one checkpoint, or an export folder")
    parser.add_argument("input", help=f"a folder of images, a {LIST_SUFFIX} list of image paths, or one image")
    parser.add_argument("--which", default=LATEST, help="a run's checkpoint: latest (default), best, or its name")
    parser.add_argument("--out", default="", help="the folder for predictions.csv (default: <run>/predict-<which>, "
                                                  "<export>/predict)")
    parser.add_argument("--topk", type=int, default=5, help="classes per image and level (default 5)")
    parser.add_argument("--batch-size", type=int, default=32, help="images per forward pass (default 32)")
    parser.add_argument("--workers", type=int, default=4, help="loader processes decoding images (default 4)")
    parser.add_argument("--device", default="", help="auto, cpu or cuda (default: the run's; auto for an export)")
    parser.add_argument("--precision", default="", help="fp32, bf16 or fp16 (default: the run's; fp32 for an export)")
    parser.add_argument("overrides", nargs="*", help="key=value changes to a run's config, e.g. data.root=...")
    args = parser.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    try:
        path = predict(args.run, args.input, args.out, args.which, args.topk, args.batch_size, args.workers,
                       args.device, args.precision, args.overrides)
    except UserError as error:
        fail(user_message(error))
    print(f"predictions written to {path}", flush=True)


if __name__ == "__main__":
    exit_after(main)
