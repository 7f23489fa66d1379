"""timm_imagenet on a tiny 3-class ImageFolder of JPEGs: end to end, bit-exact resume after SIGKILL,
exact top-1/top-5 across ranks, the resumable repeated-augmentation sampler, presets, weights, data prep."""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path

import pytest
import torch

from common.entry import CONF_DIR, compose_config
from common.errors import UserError
from common.records.loggers import METRICS_FILE, read_metrics_file
from data_prep import timm_imagenet as prep
from recipes.timm_imagenet.config import ModelConfig
from recipes.timm_imagenet.data import resolve, train_augmentation
from recipes.timm_imagenet.model import build_model
from recipes.timm_imagenet.sampler import RepeatedAugmentationSampler
from tests.conftest import assert_ok, read_summary, run_recipe
from tests.resume import kill_signal_resume
from tools.tiny_data import write_image_folder

RECIPE = "timm_imagenet"
PRESETS = {  # preset: (timm model, published parameter count in millions)
    "timm_resnet50": ("resnet50", 25.6),
    "timm_resnet152": ("resnet152", 60.2),
    "timm_efficientnet_b0": ("efficientnet_b0", 5.3),
    "timm_efficientnet_b7": ("efficientnet_b7", 66.3),
    "timm_efficientnetv2_s": ("efficientnetv2_s", 21.5),
    "timm_efficientnetv2_xl": ("efficientnetv2_xl", 208.1),
    "timm_vit_base_patch16_224": ("vit_base_patch16_224", 86.6),
    "timm_vit_large_patch16_224": ("vit_large_patch16_224", 304.3),
}
TINY = [
    "trainer.deterministic=true",  # the digest comparisons hold on a GPU too
    "model.name=test_resnet",
    "data.train_size=32",
    "data.eval_size=32",
    "trainer.batch_size=8",
    "trainer.precision=fp32",
    "trainer.num_workers=0",
    "logging.backend=none",
    "logging.progress_bar=false",
    "checkpoint.every_seconds=0",
    "checkpoint.async_save=false",
]


@pytest.fixture(scope="session")
def imagenet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 classes of 40x40 JPEGs: 16 train and 5 val images per class (15 val: odd on 2 ranks)."""
    return write_image_folder(tmp_path_factory.mktemp("imagenet"), train_per_class=16, val_per_class=5)


def overrides(data: Path, run_dir: Path | None, *extra: str) -> list[str]:
    return [f"data.root={data}", *([f"run_dir={run_dir}"] if run_dir else []), *TINY, *extra]


def test_end_to_end_learns_stages_data_and_writes_outputs(imagenet: Path, tmp_path: Path) -> None:
    run_dir, stage = tmp_path / "run", tmp_path / "node_local"
    settings = ["trainer.epochs=4", "optim.lr=0.05", "trainer.lr_scaling=none", "optim.warmup_epochs=0",
                "data.eval_size=40", "data.stage_to_local=true", f"data.stage_dir={stage}",
                "logging.backend=tensorboard", "trainer.log_every_steps=2", "ema.enabled=true", "ema.decay=0.9"]
    result = run_recipe(RECIPE, overrides(imagenet, run_dir, *settings))
    assert_ok(result)
    summary = read_summary(run_dir)
    assert summary["steps"] == 4 * (48 // 8) and summary["epochs"] == 4
    assert summary["num_classes"] == 3 and summary["model"] == "test_resnet"
    assert summary["metrics"]["eval/top1"] > 0.6, "each class has its own colour; training did not learn"
    assert len(summary["ema_digest"]) == 64 and summary["ema_digest"] != summary["model_digest"]
    assert {"eval_ema/loss", "eval_ema/top1", "eval_ema/top5"} <= set(summary["metrics"])
    assert "train 32px bilinear decoded on cpu, eval 40px bilinear (crop_pct 0.875), 0 loader workers" in result.stdout
    assert "data.decode=auto: the device is not a GPU" in result.stdout, "auto says what it chose and why"
    staged = list(stage.iterdir())
    assert len(staged) == 1 and (staged[0] / ".staging-complete").is_file()
    assert f"train: 48 images of {staged[0]}, listed in {staged[0] / 'train.index.npz'}" in result.stdout
    assert len(list((staged[0] / "train").rglob("*.JPEG"))) == 48
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert list((run_dir / "checkpoints").glob("AtomicDirectory_checkpoint_*_force")), "no best checkpoint"

    again = run_recipe(RECIPE, overrides(imagenet, run_dir, *settings))
    assert_ok(again)
    assert "resumed from" in again.stdout
    rerun = read_summary(run_dir)
    assert rerun["model_digest"] == summary["model_digest"] and rerun["resumes"] == 1


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "stop_signal"), [pytest.param(1, signal.SIGTERM, id="1-SIGTERM"),
                                                    pytest.param(2, signal.SIGUSR1, id="2-SIGUSR1")])
def test_sigkill_mid_epoch_then_a_stop_signal_then_resume_is_bit_exact(imagenet: Path, tmp_path: Path, nproc: int,
                                                                       stop_signal: signal.Signals) -> None:
    """Every source of randomness at once: crops and a policy drawn in workers (the policy applied
    there with one process, on the device with data.decode=gpu with two), random erasing, repeated
    augmentation, Mixup/CutMix, drop path, EMA and gradient accumulation; checkpoints written in the
    background (the recipe's default), and with one process the SIGKILL lands in the middle of one.
    With two, the 15 val images are split 8 + 7 and scored exactly as on one rank, and each run
    stages its data once (local rank 0 copies while rank 1 waits), and trains with progressive
    resizing (epoch 0 at 16 px, epoch 1 at 32), which the device crops to each epoch's size."""
    decode, policy, workers = ("cpu", "rand-m9-mstd0.5-inc1", 1) if nproc == 1 else ("gpu", "ta_wide", 0)
    progressive = ["data.progressive.start_size=16", "data.progressive.step=16", "data.progressive.end_epoch=1",
                   "trainer.log_every_steps=1"]
    # the one-rank evaluation of the stop checkpoint is a run that ends with epoch 0, before the ramp's end
    no_ramp = ("data.progressive.start_size=0", "data.progressive.end_epoch=0")
    stage = tmp_path / "node_local"
    settings = ["trainer.epochs=2", f"trainer.num_workers={workers}", "seed=3", "trainer.batch_size=4",
                f"data.decode={decode}", f"data.auto_augment={policy}", "data.re_prob=0.5",
                "data.repeated_augmentation=3", "data.ra_selected_round=0", "mixup.mixup_alpha=0.8",
                "mixup.cutmix_alpha=1.0", "model.drop_path_rate=0.2", "ema.enabled=true", "ema.decay=0.9",
                "trainer.global_batch_size=8", "optim.opt=adamw", "optim.lr=0.002", "optim.weight_decay=0.05",
                "checkpoint.async_save=true", f"data.stage_to_local={nproc == 2}", f"data.stage_dir={stage}",
                *(progressive if nproc == 2 else [])]
    summary = kill_signal_resume(RECIPE, overrides(imagenet, None, *settings), tmp_path, nproc, stop_signal,
                                 extra_digests=("ema_digest",), kill="mid-write" if nproc == 1 else "mid-epoch",
                                 one_rank_eval_overrides=no_ramp)
    assert summary["steps"] == 2 * 48 // 8
    assert round(summary["metrics"]["eval/top1"] * 15, 6).is_integer()  # a count over all 15 images
    if nproc == 2:
        sizes = {record["step"]: record["train/image_size"] for record in
                 read_metrics_file(tmp_path / "run" / "tensorboard" / METRICS_FILE) if "train/image_size" in record}
        assert sizes and all(size == (16 if step <= 6 else 32) for step, size in sizes.items()), sizes
        staged = list(stage.iterdir())
        assert len(staged) == 1 and (staged[0] / ".staging-complete").is_file()


def test_top1_and_top5_are_counted_per_image() -> None:
    """Seven classes, so that top-5 can miss: hand-made logits with known ranks of the label, in
    two batches (the classification metrics every single-label recipe reports)."""
    from common.pytorch.metrics import SumMetrics, add_classification, classification_metrics

    labels = torch.tensor([0, 1, 2, 3, 4, 5])
    ranks = [0, 1, 4, 5, 6, 0]  # where each label stands among its image's scores
    logits = torch.zeros(6, 7)
    for row, (label, rank) in enumerate(zip(labels.tolist(), ranks)):
        others = [c for c in range(7) if c != label]
        order = others[:rank] + [label] + others[rank:]
        logits[row, order] = torch.arange(7, 0, -1, dtype=torch.float)
    sums = SumMetrics(torch.device("cpu"))
    add_classification(sums, logits[:4], labels[:4])
    add_classification(sums, logits[4:], labels[4:])
    metrics = classification_metrics(sums.reduce(), "eval")
    assert metrics["eval/top1"] == 2 / 6 and metrics["eval/top5"] == 4 / 6
    assert metrics["eval/loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, labels).item())


@pytest.mark.parametrize("decode", ["cpu", "gpu"])
def test_a_corrupt_jpeg_is_a_one_line_error(imagenet: Path, tmp_path: Path, decode: str) -> None:
    """Cut after its header, so that with data.decode=gpu the worker passes it on and the device
    decoder (here torchvision's CPU decoder, in the main process) is the one that fails."""
    broken = tmp_path / "broken"
    write_image_folder(broken, train_per_class=4, val_per_class=1, size=32)
    bad = sorted((broken / "train").rglob("*.JPEG"))[0]
    data = bad.read_bytes()
    bad.write_bytes(data[: data.index(b"\xff\xda") + 40])  # 40 bytes into the scan (after the SOS marker)
    result = run_recipe(RECIPE, overrides(broken, tmp_path / "run", "trainer.num_workers=1", "trainer.epochs=1",
                                          "trainer.batch_size=12", f"data.decode={decode}"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {bad} is not a readable image"), result.stderr
    assert "Traceback" not in result.stderr + result.stdout


# ---- in-process checks: sampler, presets, weights, layout errors, data prep ----------------------


def test_repeated_augmentation_sampler_spreads_copies_over_ranks() -> None:
    samplers = [RepeatedAugmentationSampler(40, repeats=3, rank=r, world_size=3, seed=1, selected_round=8)
                for r in range(3)]
    for sampler in samplers:
        sampler.set_epoch(2)
    keys = [list(sampler) for sampler in samplers]
    assert all(len(k) == 40 // 3 for k in keys)  # 40 images rounded to 40 positions, 13 per rank
    first_positions = [keys[r][0] for r in range(3)]  # positions 0, 1, 2: the three copies of one image
    assert len({index for _, index in first_positions}) == 1
    assert sorted(draw for draw, _ in first_positions) == [6, 7, 8]  # epoch 2 x 3 repeats + copy
    all_keys = [key for rank_keys in keys for key in rank_keys]
    assert len(set(all_keys)) == len(all_keys)  # no image is augmented twice with the same seed
    assert max(Counter(index for _, index in all_keys).values()) == 3


def test_repeated_augmentation_sampler_resumes_on_another_world_size() -> None:
    def keys_from(sampler: RepeatedAugmentationSampler) -> list:
        return list(sampler)

    whole = RepeatedAugmentationSampler(50, repeats=2, seed=4, selected_round=0)
    whole.set_epoch(1)
    order = keys_from(whole)

    first = [RepeatedAugmentationSampler(50, repeats=2, rank=r, world_size=2, seed=4, selected_round=0)
             for r in range(2)]
    for sampler in first:
        sampler.set_epoch(1)
    done = [keys_from(sampler)[:5] for sampler in first]  # 5 samples per rank, then the job stops
    for sampler in first:
        sampler.advance(5)
    state = first[0].state_dict()

    rest = RepeatedAugmentationSampler(50, repeats=2, world_size=1, seed=4, selected_round=0)
    rest.load_state_dict(state)
    interleaved = [key for pair in zip(*done) for key in pair]
    assert interleaved + keys_from(rest) == order  # nothing skipped or repeated across the restart
    with pytest.raises(ValueError, match="repeats"):
        RepeatedAugmentationSampler(50, repeats=3, seed=4, selected_round=0).load_state_dict(state)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_each_preset_composes_and_its_model_and_transforms_build(preset: str, tmp_path: Path) -> None:
    assert (Path(CONF_DIR) / "experiment" / f"{preset}.yaml").read_text().count("http") >= 1, "cite the source"
    cfg = compose_config(RECIPE, [f"+experiment={preset}", f"run_dir={tmp_path}"])  # every value resolves
    model_name, millions = PRESETS[preset]
    assert cfg.model.name == model_name and not cfg.model.pretrained
    with torch.device("meta"):
        model = build_model(cfg.model, num_classes=1000)
    assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(millions, abs=0.1)
    data_config = resolve(model, cfg.data.train_size, 0.0, cfg.data.interpolation)
    assert data_config["input_size"][-1] == cfg.data.train_size
    augmentation = train_augmentation(cfg.data, data_config)
    policy = cfg.data.auto_augment.split("-")[0]
    expected = {"ta_wide": "TrivialAugmentWide", "rand": "RandAugment", "v0": "AutoAugment"}[policy]
    assert expected in repr(augmentation.per_sample)
    assert augmentation.colour_jitter == 0, "timm turns the colour jitter off when a policy is set"


def test_pretrained_weights_load_from_a_local_file(tmp_path: Path) -> None:
    source = build_model(ModelConfig(name="test_resnet"), 1000)
    weights = tmp_path / "weights.pth"
    torch.save(source.state_dict(), weights)
    cfg = ModelConfig(name="test_resnet", pretrained_file=str(weights))
    torch.manual_seed(123)  # a different random init, so equality can only come from the file
    same_classes, other_classes = build_model(cfg, 1000), build_model(cfg, 3)
    for name, tensor in source.state_dict().items():
        assert torch.equal(same_classes.state_dict()[name], tensor), name
    stem = next(name for name in source.state_dict() if name.endswith("weight"))
    assert torch.equal(other_classes.state_dict()[stem], source.state_dict()[stem])
    assert other_classes.get_classifier().out_features == 3
    random = build_model(cfg, 1000, pretrained=False).state_dict()[stem]
    assert not torch.equal(random, tensor := source.state_dict()[stem]) and random.shape == tensor.shape, \
        "pretrained=False leaves the file out"

    cfg.pretrained_file = str(tmp_path / "missing.pth")
    with pytest.raises(UserError, match="missing.pth does not exist"):
        build_model(cfg, 3)
    cfg.pretrained_file, cfg.name = "", "no_such_model"
    with pytest.raises(UserError, match="'no_such_model' is not a timm model"):
        build_model(cfg, 3)


def test_data_prep_sorts_a_flat_val_folder_and_finds_unreadable_images(tmp_path: Path) -> None:
    source = write_image_folder(tmp_path / "kaggle", train_per_class=3, val_per_class=2, size=16, flat_val=True)
    out = tmp_path / "prepared"
    counts = prep.prepare(source, out, workers=1)
    assert counts == {"classes": 3, "train": 9, "val": 6}
    wnids = sorted(p.name for p in (out / "train").iterdir())
    assert sorted(p.name for p in (out / "val").iterdir()) == wnids
    first_val = out / "val" / wnids[0] / "ILSVRC2012_val_00000001.JPEG"
    assert first_val.is_symlink() and first_val.resolve() == (source / "val" / first_val.name).resolve()

    rows = (source / "LOC_val_solution.csv").read_text().splitlines()
    (source / "LOC_val_solution.csv").write_text("\n".join(rows[:-1]) + "\n")
    with pytest.raises(UserError, match="1 images in .* have no class in LOC_val_solution.csv"):
        prep.prepare(source, tmp_path / "other", workers=1)
    (source / "LOC_val_solution.csv").write_text("\n".join(rows) + "\n")

    bad = sorted((source / "train").rglob("*.JPEG"))[1]
    bad.write_bytes(b"not a jpeg")
    with pytest.raises(UserError, match=f"1 unreadable image\\(s\\): {bad}"):
        prep.prepare(source, tmp_path / "other", workers=1)
    assert not (tmp_path / "other").exists()


def test_layout_errors_are_user_errors(imagenet: Path, tmp_path: Path) -> None:
    from recipes.timm_imagenet.data import check_layout

    with pytest.raises(UserError, match="does not exist: run `make prep-timm_imagenet"):
        check_layout(tmp_path / "nowhere", "train", "val")
    mismatched = write_image_folder(tmp_path / "mismatch", train_per_class=1, val_per_class=1, size=8)
    extra = mismatched / "val" / "n99999999"
    extra.mkdir()
    with pytest.raises(UserError, match="hold different classes"):
        check_layout(mismatched, "train", "val")
