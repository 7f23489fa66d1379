"""cifar100_resnet50 on a tiny CIFAR-100 tarball: data prep, augmentation, presets, end to end,
bit-exact resume after SIGKILL (1 and 2 gloo ranks), one-line errors."""

from __future__ import annotations

import io
import random
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import MixupConfig
from common.data.cifar100 import load_split, read_pickle
from common.data.image_batches import Normalize, random_crop_and_flip
from common.entry import compose_config
from common.errors import UserError
from common.pytorch.optim import warmup_multistep
from common.pytorch.rng import seeded_generator
from data_prep import cifar100_resnet50 as prep
from data_prep.files import file_digest
from recipes.cifar100_resnet50.config import DataConfig, ModelConfig
from recipes.cifar100_resnet50.data import MEAN, STD, BatchAugmentation, random_erase, rotate
from recipes.cifar100_resnet50.model import build_model
from tests.conftest import REPO, assert_ok, latest_step, read_summary, recipe_env, run_recipe
from tests.resume import kill_signal_resume
from tools.tiny_data import write_cifar100_tarball

RECIPE = "cifar100_resnet50"
N_TRAIN, N_TEST = 48, 16
TINY = [
    "trainer.deterministic=true",  # the digest comparisons hold on a GPU too
    "model.name=test_resnet",
    "trainer.precision=fp32",
    "trainer.batch_size=8",
    "logging.backend=none",
    "logging.progress_bar=false",
    "checkpoint.every_seconds=0",
]
# Every source of randomness the recipe has, so the resume test covers all of their seeding.
ALL_AUGMENTATIONS = [
    "data.auto_augment=trivialaugment",
    "data.rotation_degrees=15",
    "data.random_erasing=0.5",
    "mixup.mixup_alpha=0.2",
    "mixup.cutmix_alpha=1.0",
    "optim.label_smoothing=0.1",
    "ema.enabled=true",
    "ema.decay=0.9",
    "model.drop_path_rate=0.1",
    "trainer.epochs=3",
    "seed=3",
]


def overrides(data: Path, run_dir: Path | None, *extra: str) -> list[str]:
    return [f"data.root={data}", *([f"run_dir={run_dir}"] if run_dir else []), *TINY, *extra]


@pytest.fixture(scope="session")
def tarball(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CIFAR-100 python-version tarball with 48 train and 16 test images."""
    return write_cifar100_tarball(tmp_path_factory.mktemp("download") / prep.TARBALL, N_TRAIN, N_TEST)


@pytest.fixture(scope="session")
def cifar_root(tarball: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tarball prepared by the real prep code (with the test tarball's own md5)."""
    out = tmp_path_factory.mktemp("cifar100")
    prep.prepare(out, tarball, md5=file_digest(tarball))
    return out


# ---- data prep ------------------------------------------------------------------------------


def test_prep_extracts_the_pickles_and_keeps_a_verified_folder(tarball: Path, cifar_root: Path) -> None:
    folder = cifar_root / "cifar-100-python"
    assert sorted(p.name for p in folder.iterdir()) == [prep.VERIFIED_MARKER, "meta", "test", "train"]
    with tarfile.open(tarball) as archive:
        original = read_pickle(archive.extractfile("cifar-100-python/train"))
    train = load_split(cifar_root, "train")
    images, labels = train.images, train.labels
    assert images.dtype == torch.uint8 and images.shape == (N_TRAIN, 3, 32, 32)
    assert torch.equal(images.reshape(N_TRAIN, -1), torch.from_numpy(original[b"data"]))
    assert labels.tolist() == original[b"fine_labels"]
    assert prep.prepare(cifar_root, md5=file_digest(tarball)) == "already prepared"


def test_prep_rejects_a_tarball_with_the_wrong_md5_in_one_line(tarball: Path, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "data_prep.cifar100_resnet50", "--source", str(tarball.parent),
                             "--out", str(tmp_path / "out")], cwd=REPO, env=recipe_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and prep.TARBALL_MD5 in result.stderr
    assert not (tmp_path / "out" / "cifar-100-python").exists()


def test_prep_rejects_a_link_posing_as_a_pickle(tmp_path: Path) -> None:
    tarball = tmp_path / prep.TARBALL
    with tarfile.open(tarball, "w:gz") as archive:
        for name in prep.MEMBERS:
            info = tarfile.TarInfo(f"cifar-100-python/{name}")
            if name == "train":
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                archive.addfile(info)
            else:
                archive.addfile(info, io.BytesIO(b""))
    with pytest.raises(UserError, match="not a regular file"):
        prep.prepare(tmp_path / "out", tarball, md5=file_digest(tarball))
    assert not (tmp_path / "out" / "cifar-100-python").exists()


# ---- augmentation ---------------------------------------------------------------------------


def random_images(count: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (count, 3, 32, 32), dtype=np.uint8))


def test_crop_and_flip_takes_a_window_of_the_zero_padded_image() -> None:
    images = random_images()
    out = random_crop_and_flip(images, padding=4, flip=True, generator=seeded_generator(torch.device("cpu"), 1))
    padded = torch.nn.functional.pad(images, (4, 4, 4, 4))
    for image, result in zip(padded, out):
        windows = [image[:, r : r + 32, c : c + 32] for r in range(9) for c in range(9)]
        assert any(torch.equal(result, w) or torch.equal(result, w.flip(-1)) for w in windows)
    assert not torch.equal(out, images), "no sample moved: the crop offsets are not random"


def test_rotation_by_a_tiny_angle_is_the_identity() -> None:
    images = random_images().float()
    assert torch.equal(rotate(images, 1e-4, seeded_generator(torch.device("cpu"), 0)), images)


def test_random_erasing_replaces_one_rectangle_per_image() -> None:
    images = torch.zeros(8, 3, 32, 32)
    erased = random_erase(images, 1.0, seeded_generator(torch.device("cpu"), 0))
    for changed in (erased != 0).any(1):  # one [32, 32] mask per image
        rows, cols = changed.any(1).nonzero().flatten(), changed.any(0).nonzero().flatten()
        assert len(rows) and len(cols)
        box = changed[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
        assert box.all(), "the erased pixels do not form one rectangle"
        assert 0.02 * 1024 * 0.5 <= box.numel() <= 1024 / 3 * 1.5
    assert torch.equal(random_erase(images, 0.0, seeded_generator(torch.device("cpu"), 0)), images)


def test_training_augmentation_depends_only_on_its_keys_and_leaves_global_rngs_alone() -> None:
    cfg = DataConfig(auto_augment="trivialaugment", rotation_degrees=15, random_erasing=0.5)
    normalize = Normalize(MEAN, STD, torch.device("cpu"), input_max=1)
    augmentation = BatchAugmentation(cfg, MixupConfig(mixup_alpha=0.2, cutmix_alpha=1.0), 0.1, normalize)
    images, labels = random_images(8), torch.arange(8)

    def draw(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return augmentation(images, labels, seeded_generator(torch.device("cpu"), 0, step, 0), 0, step, 0, 0)

    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    before = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    x1, y1 = draw(step=5)
    after = (random.random(), np.random.rand(), torch.rand(1))
    assert before == after, "the augmentation consumed the global random generators"
    x2, y2 = draw(step=5)
    x3, _ = draw(step=6)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3)
    assert x1.shape == (8, 3, 32, 32) and y1.shape == (8, 100)
    torch.testing.assert_close(y1.sum(1), torch.ones(8))

    # An odd batch (an epoch's last micro-batch can be one): the odd sample keeps its own smoothed label.
    x_odd, y_odd = augmentation(images[:7], labels[:7], seeded_generator(torch.device("cpu"), 0), 0, 1, 0, 0)
    assert x_odd.shape == (7, 3, 32, 32) and y_odd.shape == (7, 100)
    assert y_odd[6, 6] == pytest.approx(0.9 + 0.1 / 100) and y_odd[6].sum() == pytest.approx(1.0)


# ---- model, presets, schedule -------------------------------------------------------------


def test_cifar_stem_keeps_full_resolution() -> None:
    cfg = compose_config(RECIPE, ["model.name=test_resnet"])
    model = build_model(cfg.model)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, torch.nn.Identity)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 100)


@pytest.mark.parametrize("preset", [None, "cifar100_reference", "cifar100_strong"])
def test_preset_composes_and_its_resnet50_builds(preset: str | None) -> None:
    cfg = compose_config(RECIPE, [f"+experiment={preset}"] if preset else [])
    model = build_model(cfg.model)
    # The reference table lists 23.7M parameters for its CIFAR ResNet-50.
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == 23.7
    assert cfg.optim.lr == 0.1 and cfg.trainer.batch_size == 128
    if preset == "cifar100_reference":
        assert (cfg.optim.sched, list(cfg.optim.milestones), cfg.optim.gamma) == ("multistep", [60, 120, 160], 0.2)
        assert (cfg.trainer.epochs, cfg.optim.weight_decay, cfg.optim.momentum) == (200, 5e-4, 0.9)
        assert cfg.data.rotation_degrees == 15 and cfg.name == "reference"


def test_warmup_multistep_divides_by_five_at_each_milestone() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = warmup_multistep(optimizer, warmup_steps=10, milestone_steps=[60, 120, 160], gamma=0.2)
    lrs = []
    for _ in range(200):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(0.01) and lrs[9] == pytest.approx(0.1)
    assert lrs[59] == pytest.approx(0.1) and lrs[60] == pytest.approx(0.02)
    assert lrs[120] == pytest.approx(0.004) and lrs[199] == pytest.approx(0.0008)


# ---- end to end --------------------------------------------------------------------------------


def test_end_to_end_writes_summary_and_checkpoints(cifar_root: Path, tmp_path: Path) -> None:
    """Every augmentation on: 3 epochs of 6 steps."""
    run_dir = tmp_path / "run"
    assert_ok(run_recipe(RECIPE, overrides(cifar_root, run_dir, *ALL_AUGMENTATIONS)))
    summary = read_summary(run_dir)
    assert summary["steps"] == 3 * (N_TRAIN // 8) and summary["epochs"] == 3
    assert summary["resumes"] == 0 and summary["world_size"] == 1
    assert len(summary["model_digest"]) == 64
    metrics = summary["metrics"]
    assert set(metrics) == {f"{p}/{m}" for p in ("eval", "eval_ema") for m in ("loss", "top1", "top5")}
    assert all(np.isfinite(value) for value in metrics.values())
    assert latest_step(run_dir / "checkpoints") == summary["steps"]


@pytest.mark.slow
def test_sigkill_mid_epoch_then_a_stop_signal_then_resume_is_bit_exact(cifar_root: Path, tmp_path: Path) -> None:
    """Two ranks, every augmentation, EMA included (its weights are in the metrics compared); 24
    samples per rank = 3 micro-batches of 8: each epoch ends with a 1-micro-batch step. (One
    process's SIGTERM and resume: make gpu-check, tests/test_gpu_check.py.)"""
    settings = [*(setting for setting in ALL_AUGMENTATIONS if not setting.startswith("trainer.epochs=")),
                "trainer.epochs=4", "trainer.global_batch_size=32"]
    kill_signal_resume(RECIPE, overrides(cifar_root, None, *settings), tmp_path, 2, signal.SIGTERM)


# ---- errors ----------------------------------------------------------------------------------------


def test_missing_data_is_a_one_line_error(tmp_path: Path) -> None:
    result = run_recipe(RECIPE, overrides(tmp_path / "missing", tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "make prep-cifar100_resnet50" in result.stderr


def test_unknown_model_and_stemless_model_are_user_errors() -> None:
    with pytest.raises(UserError, match="no_such_model"):
        build_model(ModelConfig(name="no_such_model"))
    with pytest.raises(UserError, match="needs a timm ResNet"):
        build_model(ModelConfig(name="test_vit", cifar_stem=True))
