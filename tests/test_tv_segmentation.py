"""tv_segmentation on tiny VOC and COCO trees written in their real formats: metrics by hand,
COCO conversion, SyncBatchNorm against BatchNorm, evaluation of varying image sizes, weights
from local files, and whole runs (resume after SIGKILL, 2-process gloo with SyncBatchNorm)."""

from __future__ import annotations

import copy
import math
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from PIL import Image
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from common.config import TrainerConfig
from common.data.loaders import PerSampleSeeded, make_loader
from common.data.sampler import ResumableDistributedSampler
from common.errors import UserError
from common.pytorch.distributed import DistInfo
from common.records.summary import state_digest
from recipes.tv_segmentation import coco
from recipes.tv_segmentation.config import DataConfig, ModelConfig, TvSegmentationConfig
from recipes.tv_segmentation.data import SegmentationDataset, eval_transform, find_pairs, pad_collate, train_transform
from recipes.tv_segmentation.metrics import ConfusionMatrix, segmentation_scores
from recipes.tv_segmentation.model import build_model
from recipes.tv_segmentation.spec import evaluator
from recipes.tv_segmentation.sync_batchnorm import AllReduceBatchNorm, convert_sync_batchnorm
from tests.conftest import REPO, assert_ok, read_summary, recipe_env, run_recipe, spawn_ranks
from tests.resume import kill_signal_resume
from tests.test_host_syncs import SyncingOps
from tools.tiny_data import write_coco, write_voc

RECIPE = "tv_segmentation"
TINY = [
    "trainer.deterministic=true",  # the digest comparisons hold on a GPU too
    "model.name=deeplabv3_mobilenet_v3_large",
    "data.base_size=40",
    "data.crop_size=40",
    "trainer.batch_size=2",
    "trainer.num_workers=0",
    "trainer.log_every_steps=2",
    "logging.backend=none",
    "logging.progress_bar=false",
    "checkpoint.every_seconds=0",
    "device=cpu",
]


def overrides(data: Path, run_dir: Path | None, *extra: str) -> list[str]:
    return [f"data.root={data}", *([f"run_dir={run_dir}"] if run_dir else []), *TINY, *extra]


@pytest.fixture(scope="session")
def voc_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 train and 5 val images of three sizes, masks with 255 outlines, classes 1, 7, 15."""
    return write_voc(tmp_path_factory.mktemp("voc") / "VOC2012", n_train=12, n_val=5)


@pytest.fixture(scope="session")
def coco_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_coco(tmp_path_factory.mktemp("coco") / "coco")


# ---------------------------------------------------------------------------------- metrics


def test_miou_by_hand_with_ignored_pixels_and_an_absent_class() -> None:
    # Classes 0..3. Pixels labelled 255 are ignored whatever is predicted there. Class 2 is
    # predicted once but never true (IoU 0, counted); class 3 appears nowhere (no IoU, left out).
    target = torch.tensor([[0, 0, 1, 1], [255, 255, 1, 0]])
    prediction = torch.tensor([[0, 1, 1, 1], [2, 0, 2, 0]])
    matrix = ConfusionMatrix(num_classes=4, device=torch.device("cpu"))
    matrix.update(target[0], prediction[0])
    matrix.update(target[1], prediction[1])
    counts = matrix.reduce()
    assert counts.tolist() == [[2, 1, 0, 0], [0, 2, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    scores = segmentation_scores(counts)
    # class 0: TP 2, union 3 + 2 - 2 = 3; class 1: TP 2, union 3 + 3 - 2 = 4; class 2: TP 0, union 1
    assert scores["iou"][:3] == pytest.approx([2 / 3, 2 / 4, 0.0])
    assert math.isnan(scores["iou"][3])
    assert scores["miou"] == pytest.approx((2 / 3 + 1 / 2 + 0) / 3)
    assert scores["pixel_accuracy"] == pytest.approx(4 / 6)


# ------------------------------------------------------------------------------------- COCO


def test_coco_instances_become_voc_class_masks_and_train_drops_small_images(coco_data: Path,
                                                                         tmp_path: Path) -> None:
    root = tmp_path / "coco"
    shutil.copytree(coco_data, root)
    assert coco.convert_split(root, "train") == 2 + 8
    kept = coco.list_file(root, "train").read_text().split()
    assert kept[:2] == ["000000000001", "000000000002"]  # 3 (no VOC object) and 4 (100 pixels) dropped
    assert "000000000003" not in kept and "000000000004" not in kept

    with Image.open(coco.masks_folder(root, "train") / "000000000001.png") as png:
        assert png.mode == "P"
        first = np.array(png)
    assert first[6, 6] == 15  # person only
    assert first[33, 40] == 7  # car only
    assert (first[12:28, 22:28] == 255).all()  # person and car overlap: ignored
    assert first[38, 2] == 0  # background
    second = np.array(Image.open(coco.masks_folder(root, "train") / "000000000002.png"))
    assert (second[6:34, 6:39] == 12).all()  # the crowd dog, from uncompressed RLE
    assert (second[0:4, 0:48] == 0).all() and second[36, 44] == 0  # traffic light is not a VOC class

    assert coco.convert_split(root, "val") == 2  # val keeps the image without annotations
    empty = np.array(Image.open(coco.masks_folder(root, "val") / "000000000102.png"))
    assert (empty == 0).all()


# ---------------------------------------------------------------------------- SyncBatchNorm


def _sync_batchnorm_rank(rank: int) -> None:
    torch.manual_seed(0)
    global_batch = torch.randn(4, 3, 5, 6) * 3 + 1
    upstream = torch.randn(4, 3, 5, 6)  # d loss / d output
    norm = nn.BatchNorm2d(3, momentum=0.1)
    nn.init.normal_(norm.weight)
    nn.init.normal_(norm.bias)
    reference = copy.deepcopy(norm)
    converted_model, converted = convert_sync_batchnorm(nn.Sequential(norm))
    synced = converted_model[0]
    assert converted == 1 and isinstance(synced, AllReduceBatchNorm)

    full_input = global_batch.clone().requires_grad_()
    (reference(full_input) * upstream).sum().backward()
    shard = slice(2 * rank, 2 * rank + 2)
    local_input = global_batch[shard].clone().requires_grad_()
    with SyncingOps() as syncing:  # nn.SyncBatchNorm selects the ranks' counts with a boolean mask
        output = synced(local_input)
    assert syncing.seen == []
    (output * upstream[shard]).sum().backward()

    expected = nn.functional.batch_norm(global_batch, None, None, reference.weight, reference.bias, True)
    torch.testing.assert_close(output.detach(), expected[shard].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(local_input.grad, full_input.grad[shard], rtol=1e-4, atol=1e-5)
    for name in ("weight", "bias"):
        summed = getattr(synced, name).grad.clone()
        dist.all_reduce(summed)
        torch.testing.assert_close(summed, getattr(reference, name).grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(synced.running_mean, reference.running_mean)
    torch.testing.assert_close(synced.running_var, reference.running_var)

    # The confusion matrix sums exactly over ranks: each rank counts half the pixels.
    target = torch.tensor([0, 1, 1, 2, 255, 2])
    prediction = torch.tensor([0, 1, 2, 2, 1, 0])
    matrix = ConfusionMatrix(3, torch.device("cpu"))
    matrix.update(target[3 * rank : 3 * rank + 3], prediction[3 * rank : 3 * rank + 3])
    assert matrix.reduce().tolist() == [[1, 0, 0], [0, 1, 1], [1, 0, 1]]


def test_sync_batchnorm_on_two_gloo_ranks_equals_batchnorm_on_the_global_batch() -> None:
    spawn_ranks(_sync_batchnorm_rank)


def test_every_batchnorm_becomes_the_all_reduce_one_whatever_the_device() -> None:
    """On CUDA too: nn.SyncBatchNorm's forward makes a host sync in every layer."""
    from torchvision.models.segmentation import deeplabv3_mobilenet_v3_large

    model = deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3)
    norms = sum(isinstance(module, nn.BatchNorm2d) for module in model.modules())
    converted_model, converted = convert_sync_batchnorm(model)
    kinds = {type(module) for module in converted_model.modules() if isinstance(module, _BatchNorm)}
    assert converted == norms > 0 and kinds == {AllReduceBatchNorm}


# ------------------------------------------------------------------------------- evaluation


def test_training_crops_pad_masks_with_255_and_depend_only_on_seed_epoch_and_index(voc_data: Path) -> None:
    # Shorter side resized to 10..40 pixels, crop 48: every crop is partly padding.
    data_cfg = DataConfig(root=str(voc_data), base_size=20, crop_size=48)
    pairs = find_pairs(data_cfg, "train")
    dataset = PerSampleSeeded(SegmentationDataset(pairs, train_transform(data_cfg), 21, augment=True), seed=0)
    image, mask = dataset[(0, 1)]
    assert image.shape == (3, 48, 48) and mask.shape == (48, 48)
    assert (mask[-1, :] == 255).all() or (mask[:, -1] == 255).all()  # padded at the bottom or right
    assert image.dtype == torch.uint8 and (image[:, -1, -1] == 0).all()  # image padded with 0 (black)
    assert set(mask.unique().tolist()) <= {0, 7, 255}  # train image 1 holds class 7; nearest-neighbour mask

    again_image, again_mask = dataset[(0, 1)]
    assert torch.equal(again_image, image) and torch.equal(again_mask, mask)
    assert any(not torch.equal(dataset[(epoch, 1)][1], mask) for epoch in range(1, 4))


class _RedDetector(nn.Module):
    """Predicts class 15 where the red channel is bright, else background: depends on pixels."""

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = torch.zeros(images.shape[0], 21, *images.shape[2:])
        logits[:, 15] = images[:, 0]
        return {"out": logits}


def test_evaluation_resizes_to_base_size_and_padding_never_counts(voc_data: Path) -> None:
    data_cfg = DataConfig(root=str(voc_data), base_size=44)
    pairs = find_pairs(data_cfg, "val")
    dataset = SegmentationDataset(pairs, eval_transform(data_cfg.base_size), num_classes=21, augment=False)
    shapes = {tuple(dataset[i][1].shape) for i in range(len(dataset))}
    assert len(shapes) == 3 and all(min(shape) == 44 for shape in shapes)  # aspect ratio kept

    single = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="single")
    results, padded = [], 0
    for batch_size in (1, 3):
        sampler = ResumableDistributedSampler(len(dataset), shuffle=False, drop_last=False)
        loader = make_loader(dataset, sampler, batch_size, num_workers=0, pin_memory=False, collate_fn=pad_collate)
        padded += sum(int((masks == 255).sum()) for _, masks in loader)
        cfg = TvSegmentationConfig(data=data_cfg, trainer=TrainerConfig(eval_batch_size=batch_size, num_workers=0))
        results.append(evaluator(cfg, single, "val")(_RedDetector()))
    assert results[0] == results[1]
    assert 0 < results[0]["eval/miou"] < 1
    unpadded = sum(int((dataset[i][1] == 255).sum()) for i in range(len(dataset)))
    assert padded > 2 * unpadded, "batches of 3 mixed sizes must have been padded with 255"


# ---------------------------------------------------------------------------------- weights


def test_weights_come_from_local_files_and_bad_ones_are_user_errors(tmp_path: Path) -> None:
    import torchvision

    torch.manual_seed(1)
    classifier = torchvision.models.mobilenet_v3_large()
    backbone_file = tmp_path / "backbone.pt"
    torch.save(classifier.state_dict(), backbone_file)
    model = build_model(ModelConfig(name="deeplabv3_mobilenet_v3_large", weights_backbone=str(backbone_file)))
    for key, tensor in model.backbone.state_dict().items():
        assert torch.equal(tensor, classifier.state_dict()[f"features.{key}"]), key

    full_file = tmp_path / "full.pt"
    torch.save({"model": model.state_dict()}, full_file)  # a checkpoint-style file works too
    reloaded = build_model(ModelConfig(name="deeplabv3_mobilenet_v3_large", weights=str(full_file)))
    assert state_digest(reloaded.state_dict()) == state_digest(model.state_dict())

    torch.save({"features.0.0.weight": torch.zeros(1)}, tmp_path / "wrong.pt")
    with pytest.raises(UserError, match="does not fit the backbone"):
        build_model(ModelConfig(weights_backbone=str(tmp_path / "wrong.pt")))
    with pytest.raises(UserError, match="does not exist"):
        build_model(ModelConfig(weights=str(tmp_path / "missing.pt")))
    with pytest.raises(UserError, match="cannot build"):
        build_model(ModelConfig(weights="NoSuch_Weights.V1"))
    with pytest.raises(UserError, match="not a torchvision segmentation model"):
        build_model(ModelConfig(name="resnet50"))


# ---------------------------------------------------------------------------- whole runs


@pytest.mark.slow
def test_sigkill_mid_epoch_then_a_stop_signal_then_resume_is_bit_exact(voc_data: Path, tmp_path: Path) -> None:
    """Two processes: BatchNorm synchronised across them, and the 5 val images (three sizes) split
    3 + 2 must give exactly the confusion matrix of one rank: every mIoU and IoU equal. (One
    process's SIGTERM and resume: make gpu-check, tests/test_gpu_check.py.) LR-ASPP, torchvision's
    smallest segmentation model, would save 7 s here, but its tiny run's metrics do not tell a
    confusion matrix of rank 0's pixels from one of every rank's (mutation check)."""
    settings = ["trainer.epochs=2", "trainer.num_workers=0", "seed=3", "trainer.batch_size=1"]
    summary = kill_signal_resume(RECIPE, overrides(voc_data, None, *settings), tmp_path, 2, signal.SIGTERM)
    assert summary["steps"] == 2 * 12 // 2 and summary["epochs"] == 2
    assert {"eval/miou", "eval/pixel_accuracy", "eval/iou/background"} <= set(summary["metrics"])
    assert list((tmp_path / "run" / "checkpoints").glob("AtomicDirectory_checkpoint_*_force")), "no best checkpoint"


def test_coco_prepared_by_data_prep_trains(coco_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "prepared"
    prep = subprocess.run([sys.executable, "-m", "data_prep.tv_segmentation", "--source", str(coco_data),
                           "--out", str(out), "--workers", "1"], cwd=REPO, env=recipe_env(),
                          capture_output=True, text=True, timeout=120)
    assert_ok(prep)
    assert "10 train, 2 val images" in prep.stdout
    assert (out / "coco" / "train2017").is_symlink()

    run_dir = tmp_path / "run"
    result = run_recipe(RECIPE, overrides(out / "coco", run_dir, "data.dataset=coco", "trainer.max_steps=2"))
    assert_ok(result)
    assert "on coco (10 train images)" in result.stdout
    summary = read_summary(run_dir)
    assert summary["steps"] == 2 and summary["dataset"] == "coco"


def test_missing_data_is_a_one_line_error(voc_data: Path, tmp_path: Path) -> None:
    broken = tmp_path / "VOC2012"
    shutil.copytree(voc_data, broken)
    missing = broken / "SegmentationClass" / "2007_train_0003.png"
    missing.unlink()
    result = run_recipe(RECIPE, overrides(broken, tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {missing} is listed in the train split but missing"]
    with pytest.raises(UserError, match="does not exist"):
        find_pairs(DataConfig(root=str(tmp_path / "nowhere")), "train")
