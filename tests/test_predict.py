"""Predicting on new images (``make predict``, ``common/after_training/predict.py``): a recipe's evaluation
split predicted from its files gives the top-1 accuracy ``make eval`` reports; an export folder alone
predicts what its run predicts; unreadable files are named and skipped; fungitastic predicts every
taxonomic level; tv_segmentation writes palette masks and their classes' pixel shares."""

from __future__ import annotations

import csv
import json
import struct
import subprocess
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from common.after_training.export import export_run
from common.after_training.trained import open_run
from common.data import cifar100
from common.recipes import load_recipe
from tests.conftest import REPO, assert_ok, recipe_env
from tests.trained_runs import (
    cifar_data,
    cifar_run,
    dinov2_run,
    evaluate_here,
    fashion_data,
    fashion_pngs,
    fashion_run,
    fungi_data,
    fungi_run,
    imagenet_data,
    predict_here,
    segmentation_run,
    timm_run,
    voc_data,
)


def top1_accuracy(rows: list[dict[str, str]], label_of: dict[str, str]) -> float:
    return sum(row["class_1"] == label_of[row["path"]] for row in rows) / len(rows)


def mean_loss(rows: list[dict[str, str]], label_of: dict[str, str], num_classes: int) -> float:
    """The mean cross-entropy of the rows' probabilities (every class listed: TOPK >= the classes)."""
    losses = []
    for row in rows:
        probability = {row[f"class_{rank}"]: float(row[f"class_prob_{rank}"]) for rank in range(1, num_classes + 1)}
        losses.append(-np.log(probability[label_of[row["path"]]]))
    return float(np.mean(losses))


def test_predicting_the_evaluation_split_gives_the_top1_make_eval_reports(tmp_path_factory: pytest.TempPathFactory,
                                                                         tmp_path: Path) -> None:
    run = timm_run(tmp_path_factory)  # kept an EMA: predict uses it, as make export does
    val = imagenet_data(tmp_path_factory) / "val"
    rows = predict_here(run, val, tmp_path / "timm")
    label_of = {str(path): path.parent.name for path in val.rglob("*.JPEG")}
    assert sorted(row["path"] for row in rows) == sorted(label_of) and not any(row["error"] for row in rows)
    metrics = evaluate_here("timm_imagenet", run)["metrics"]
    assert top1_accuracy(rows, label_of) == pytest.approx(metrics["eval_ema/top1"])
    # the same probabilities, not only the same winners: the evaluation's own input, to 6 decimals
    assert mean_loss(rows, label_of, 3) == pytest.approx(metrics["eval_ema/loss"], abs=1e-4)
    assert {"class_3", "class_prob_3"} <= set(rows[0]) and "class_4" not in rows[0]  # TOPK=5 of 3 classes
    probabilities = [float(rows[0][f"class_prob_{rank}"]) for rank in range(1, 4)]
    assert probabilities == sorted(probabilities, reverse=True) and sum(probabilities) == pytest.approx(1, abs=1e-5)

    run = fashion_run(tmp_path_factory)
    label_of = fashion_pngs(fashion_data(tmp_path_factory), tmp_path / "pngs")
    rows = predict_here(run, tmp_path / "pngs", tmp_path / "fashion", "--topk", "10")
    metrics = evaluate_here("fashion_mnist", run)["metrics"]
    assert top1_accuracy(rows, label_of) == pytest.approx(metrics["eval/top1"]) and 0.3 < metrics["eval/top1"] < 1
    assert mean_loss(rows, label_of, 10) == pytest.approx(metrics["eval/loss"], abs=1e-4)


@pytest.mark.parametrize(("recipe", "trained", "evaluated"), [("cifar100_resnet50", cifar_run, "eval_ema"),
                                                             ("dinov2_fsdp", dinov2_run, "eval")])
def test_cifar_images_from_files_predict_as_the_split_evaluates(recipe: str, trained: Callable, evaluated: str,
                                                                tmp_path_factory: pytest.TempPathFactory,
                                                                tmp_path: Path) -> None:
    """CIFAR-100's test split written as PNGs: the evaluation's numbers (cifar_run keeps an EMA; dinov2_run's
    shards of 2 ranks are read whole, in one process)."""
    run = trained(tmp_path_factory)
    root = cifar_data(tmp_path_factory)
    split, names = cifar100.load_split(root, "test"), cifar100.class_names(root)
    label_of = {}
    for i, (image, label) in enumerate(zip(split.images.numpy(), split.labels.tolist())):
        path = tmp_path / "pngs" / f"{i:03d}.png"
        path.parent.mkdir(exist_ok=True)
        Image.fromarray(image.transpose(1, 2, 0)).save(path)
        label_of[str(path)] = names[label]
    rows = predict_here(run, tmp_path / "pngs", tmp_path / "out", "--topk", "100")
    metrics = evaluate_here(recipe, run)["metrics"]
    assert top1_accuracy(rows, label_of) == pytest.approx(metrics[f"{evaluated}/top1"])
    assert mean_loss(rows, label_of, 100) == pytest.approx(metrics[f"{evaluated}/loss"], abs=1e-4)


def test_an_export_folder_alone_predicts_what_its_run_predicts(tmp_path_factory: pytest.TempPathFactory,
                                                               tmp_path: Path) -> None:
    run = fashion_run(tmp_path_factory)
    fashion_pngs(fashion_data(tmp_path_factory), tmp_path / "pngs")
    images = sorted((tmp_path / "pngs").iterdir())[:6]
    listing = tmp_path / "some.txt"
    listing.write_text("".join(f"pngs/{path.name}\n" for path in images))  # relative to the list's folder
    from_run = predict_here(run, listing, tmp_path / "run")
    export = export_run(open_run(run), tmp_path / "export")
    result = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", "predict", f"RUN={export}",
                             f"INPUT={listing}", "TOPK=5"], cwd=REPO, env=recipe_env(), capture_output=True,
                            text=True, timeout=300)
    assert_ok(result)
    assert f"predictions written to {export / 'predict' / 'predictions.csv'}" in result.stdout
    with (export / "predict" / "predictions.csv").open() as file:
        from_export = list(csv.DictReader(file))
    assert [row["path"] for row in from_export] == [str(tmp_path / "pngs" / path.name) for path in images]
    assert from_export == from_run


def test_an_export_older_than_predict_is_refused_in_one_line(tmp_path_factory: pytest.TempPathFactory,
                                                              tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    export = export_run(open_run(timm_run(tmp_path_factory)), tmp_path / "export")
    metadata = json.loads((export / "metadata.json").read_text())
    del metadata["input"]["crop_mode"]  # what an export written before make predict lacks
    (export / "metadata.json").write_text(json.dumps(metadata))
    image = sorted((imagenet_data(tmp_path_factory) / "val").rglob("*.JPEG"))[0]
    with pytest.raises(SystemExit) as stop:
        predict_here(export, image, tmp_path / "out")
    assert stop.value.code == 2
    assert f"the metadata of {export} has no 'crop_mode'" in capsys.readouterr().err


def png_header_only(path: Path, width: int, height: int) -> Path:
    """A PNG that declares ``width`` x ``height`` and holds no pixels: PIL refuses it as a decompression bomb on
    opening when the size is over twice ``Image.MAX_IMAGE_PIXELS``."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b""))
    return path


def test_unreadable_files_are_named_and_the_rest_predicted(tmp_path_factory: pytest.TempPathFactory,
                                                           tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = timm_run(tmp_path_factory)
    val = imagenet_data(tmp_path_factory) / "val"
    good = sorted(val.rglob("*.JPEG"))[:2]
    folder = tmp_path / "mixed"
    folder.mkdir()
    for path in good:
        (folder / path.name).write_bytes(path.read_bytes())
    data = good[0].read_bytes()
    bad = {"truncated.jpg": data[: len(data) // 2], "notes.jpg": b"not an image at all\n"}
    for name, content in bad.items():
        (folder / name).write_bytes(content)
    over = int((2 * Image.MAX_IMAGE_PIXELS) ** 0.5) + 2
    png_header_only(folder / "bomb.png", over, over)
    rows = predict_here(run, folder, tmp_path / "out")
    stderr = capsys.readouterr().err
    errors = {Path(row["path"]).name: row["error"] for row in rows}
    for name in (*bad, "bomb.png"):
        assert errors[name] and str(folder / name) in errors[name], f"{name} is named in the error column"
        assert sum(line.startswith("error: ") and str(folder / name) in line for line in stderr.splitlines()) == 1
        assert not rows[[Path(row["path"]).name for row in rows].index(name)]["class_1"]
    assert "decompression bomb" in errors["bomb.png"]
    assert all(not errors[path.name] for path in good)
    assert all(row["class_1"] for row in rows if not row["error"])

    only_bad = tmp_path / "bad"
    only_bad.mkdir()
    (only_bad / "notes.jpg").write_bytes(b"not an image at all\n")
    with pytest.raises(SystemExit) as stop:
        predict_here(run, only_bad, tmp_path / "none")
    assert stop.value.code == 2
    assert "none of the 1 images of INPUT could be read" in capsys.readouterr().err


def test_fungitastic_predicts_every_taxonomic_level(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    run = fungi_run(tmp_path_factory)
    images = sorted(fungi_data(tmp_path_factory).parent.rglob("test/*/*.JPG"))
    listing = tmp_path / "images.txt"
    listing.write_text("".join(f"{path}\n" for path in images))
    rows = predict_here(run, listing, tmp_path / "out", "--topk", "2")
    metadata = load_recipe("fungitastic").export_metadata(open_run(run).cfg)  # what its export would hold
    assert len(rows) == len(images) and len(metadata["levels"]) > 1
    for level in metadata["levels"]:
        names = set(metadata["taxonomy"]["name_to_index"][level])
        ranks = range(1, min(2, len(names)) + 1)  # TOPK=2, of a level's classes
        assert f"{level}_{len(ranks) + 1}" not in rows[0]
        for row in rows:
            picked = [row[f"{level}_{rank}"] for rank in ranks]
            assert set(picked) <= names and len(set(picked)) == len(picked)
            probabilities = [float(row[f"{level}_prob_{rank}"]) for rank in ranks]
            assert probabilities == sorted(probabilities, reverse=True)
    species = {path.name: row["species_1"] for path, row in zip(images, rows)}
    assert len(set(species.values())) > 1, "the images of different species are told apart"


def test_tv_segmentation_writes_a_palette_mask_per_image_and_the_pixel_shares(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    run = segmentation_run(tmp_path_factory)
    images = sorted((voc_data(tmp_path_factory) / "JPEGImages").glob("*val*.jpg"))
    with Image.open(images[0]) as picture:  # one larger than data.base_size: its mask is scaled back to its size
        picture.resize((picture.width * 2 + 1, picture.height * 2)).save(tmp_path / "larger.jpg")
    images.append(tmp_path / "larger.jpg")
    listing = tmp_path / "val.txt"
    listing.write_text("".join(f"{path}\n" for path in images))
    rows = predict_here(run, listing, tmp_path / "out")  # 3 sizes in batches of 4: padded as evaluation pads
    classes = load_recipe("tv_segmentation").export_metadata(open_run(run).cfg)["classes"]
    assert len(rows) == len(images)
    for row, image in zip(rows, images):
        mask_path = tmp_path / "out" / row["mask"]  # relative to the CSV's folder
        assert mask_path.name == f"{image.stem}.png" and tmp_path / "out" / "masks" in mask_path.parents
        with Image.open(mask_path) as mask, Image.open(image) as picture:
            assert mask.mode == "P" and mask.size == picture.size
            assert mask.getpalette()[:6] == [0, 0, 0, 128, 0, 0]  # Pascal VOC's: background black, class 1 red
            labels = np.array(mask)
        counts = np.bincount(labels.flatten(), minlength=len(classes)) / labels.size
        shares = [float(row[f"share_{name}"]) for name in classes]
        assert shares == pytest.approx(counts.tolist(), abs=1e-6) and sum(shares) == pytest.approx(1)
