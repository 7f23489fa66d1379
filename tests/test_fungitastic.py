"""fungitastic on a tiny FungiTastic-format dataset (CSVs + JPEGs, four species in two genera):
data prep, metrics against scikit-learn, pretrained loading, end to end, SIGKILL resume, 2 ranks."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.metrics import f1_score
from sklearn.utils.class_weight import compute_class_weight

from common.data.images import PathImages, ResizedImages
from common.entry import user_message
from common.errors import UserError
from recipes.fungitastic import metadata
from recipes.fungitastic.config import DataConfig, ModelConfig
from recipes.fungitastic.data import split_files
from recipes.fungitastic.metrics import TaxonomyMetrics, species_marginals
from recipes.fungitastic.model import build_model, input_normalization, load_pretrained
from tests.conftest import REPO, assert_ok, read_summary, recipe_env, run_recipe
from tests.resume import kill_signal_resume
from tools.tiny_data import FUNGI_TAXA, write_fungitastic

RECIPE = "fungitastic"
LEVELS = ["species", "genus", "family", "order", "class", "phylum"]
TINY = [
    "trainer.deterministic=true",  # the digest comparisons hold on a GPU too
    "model.name=test_vit",
    "model.pretrained=",
    "model.drop_path_rate=0",
    "data.image_size=32",
    "trainer.batch_size=4",
    "trainer.precision=fp32",
    "trainer.num_workers=0",
    "optim.lr=0.001",
    "logging.backend=none",
    "logging.progress_bar=false",
    "checkpoint.every_seconds=0",
]
TRAIN_ROWS = 24  # 6 per species in the fake training split


def prep(source: Path, out: Path, *args: str, mini: bool = False,
         weights: tuple[str, ...] = ("model.pretrained=",)) -> subprocess.CompletedProcess:
    """The prep script; by default for a config without pretrained weights (the tests train from scratch)."""
    env = recipe_env(MINI="1" if mini else "0")
    return subprocess.run([sys.executable, "-m", "data_prep.fungitastic", "--source", str(source), "--out", str(out),
                           *args, *weights], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def overrides(data: Path, run_dir: Path | None, *extra: str) -> list[str]:
    return [f"data.root={data}", *([f"run_dir={run_dir}"] if run_dir else []), *TINY, *extra]


@pytest.fixture(scope="session")
def fungi_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake download, prepared with MINI=1 (two rows per species in the minimal CSVs)."""
    base = tmp_path_factory.mktemp("fungitastic")
    write_fungitastic(base / "download")
    assert_ok(prep(base / "download", base / "data", "--per-species", "2", mini=True))
    return base / "data"


@pytest.fixture(scope="session")
def reference_run(fungi_data: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """An uninterrupted 3-epoch run (no DataLoader workers)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    result = run_recipe(RECIPE, overrides(fungi_data, run_dir, *RESUME_SETTINGS))
    assert_ok(result)
    return run_dir, result


RESUME_SETTINGS = ["trainer.epochs=3", "model.derive_from_species=true",
                   "loss.level_weights.phylum=0.5", "seed=3"]


# ------------------------------------------------------------------------------------ data prep


def test_prep_builds_mappings_class_weights_and_minimal_subsets(fungi_data: Path) -> None:
    prepared = fungi_data / "prepared" / "FungiTastic-Mini"
    mappings = json.loads((prepared / metadata.MAPPINGS_FILE).read_text())
    assert mappings["levels"] == LEVELS
    assert mappings["name_to_index"]["species"] == {taxon[1]: taxon[0] for taxon in FUNGI_TAXA}
    assert mappings["name_to_index"]["genus"] == {"Amanita": 0, "Russula": 1}
    assert mappings["name_to_index"]["order"] == {"Agaricales": 0, "Russulales": 1}
    assert mappings["num_classes"] == {"species": 4, "genus": 2, "family": 2, "order": 2, "class": 1, "phylum": 1}
    assert mappings["species_parents"]["Russula emetica"] == {
        "genus": "Russula", "family": "Russulaceae", "order": "Russulales", "class": "Agaricomycetes",
        "phylum": "Basidiomycota"}
    assert "Boletus edulis" not in mappings["species_parents"], "the unknown species (-1) is not a class"

    weights = torch.load(prepared / metadata.CLASS_WEIGHTS_FILE, weights_only=True)
    train = pd.read_csv(fungi_data / "metadata" / "FungiTastic-Mini" / "FungiTastic-Mini-Train.csv")
    for level in LEVELS:
        labels = train[level].map(mappings["name_to_index"][level]) if level != "species" else train["category_id"]
        expected = compute_class_weight("balanced", classes=np.arange(mappings["num_classes"][level]), y=labels)
        np.testing.assert_allclose(weights[level].numpy(), expected, rtol=1e-6)

    minimal = pd.read_csv(prepared / "FungiTastic-Mini-Train-Minimal.csv")
    assert minimal["category_id"].value_counts().to_dict() == {0: 2, 1: 2, 2: 2, 3: 2}
    first_two = train.groupby("category_id").head(2)
    assert sorted(minimal["filename"]) == sorted(first_two["filename"])
    assert list(minimal.columns) == list(train.columns)


def test_prep_reports_a_missing_image_and_fails_unless_told_to_skip(tmp_path: Path) -> None:
    download = write_fungitastic(tmp_path / "download")
    val_csv = download / "metadata" / "FungiTastic-Mini" / "FungiTastic-Mini-Val.csv"
    gone = pd.read_csv(val_csv).query("category_id != -1")["filename"].iloc[3]
    (download / "FungiTastic-Mini" / "val" / "300p" / gone).unlink()

    result = prep(download, tmp_path / "data")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "1 of 9 images listed in FungiTastic-Mini-Val.csv are missing from" in lines[0]
    assert gone in lines[0]
    assert (tmp_path / "data" / "prepared" / "FungiTastic-Mini" / metadata.MAPPINGS_FILE).is_file()

    skipped = prep(download, tmp_path / "data", "--skip-missing")
    assert_ok(skipped)
    assert "warning: 1 of 9 images listed in FungiTastic-Mini-Val.csv are missing" in skipped.stdout

    mappings = metadata.load_mappings(tmp_path / "data" / "prepared", "mini")
    cfg = DataConfig(root=str(tmp_path / "data"), prepared_dir=str(tmp_path / "data" / "prepared"))
    with pytest.raises(UserError, match=f"1 of 8 images .* missing .*{gone}.*data.skip_missing=true"):
        split_files(cfg, "val", mappings, str(tmp_path / "run"), 0)
    cfg.skip_missing = True
    split = split_files(cfg, "val", mappings, str(tmp_path / "run"), 0)
    assert (split.skipped_missing, split.unknown_species, len(split.images)) == (1, 1, 7)

    mappings_file = tmp_path / "data" / "prepared" / "FungiTastic-Mini" / metadata.MAPPINGS_FILE
    older = {("ranks" if key == "levels" else key): value for key, value in mappings.items()}
    mappings_file.write_text(json.dumps(older))
    with pytest.raises(UserError, match=r"written by an older `make prep-fungitastic` .*: rerun it"):
        metadata.load_mappings(tmp_path / "data" / "prepared", "mini")


def test_both_csv_name_forms_and_label_columns_are_read(tmp_path: Path) -> None:
    write_fungitastic(tmp_path, mini=False, closed_set_names=True, label_column="class_id")
    csv = metadata.find_csv(tmp_path, "full", "val")
    assert csv.name == "FungiTastic-ClosedSet-Val.csv"
    frame = metadata.read_metadata(csv)
    assert (frame["label"] == frame["class_id"]).all()
    known, unknown = metadata.known_species(frame)
    assert unknown == 1 and len(known) == 8 and (known["label"] >= 0).all()
    with pytest.raises(UserError, match="no FungiTastic-Mini-Val.csv or FungiTastic-Mini-ClosedSet-Val.csv"):
        metadata.find_csv(tmp_path, "mini", "val")
    with pytest.raises(UserError, match="the image size must be one of 300p, 500p, 720p, fullsize, not '1000p'"):
        metadata.image_dir(tmp_path, "full", "val", "1000p")


def test_a_corrupt_jpeg_is_one_line_even_when_a_dataloader_worker_reports_it(tmp_path: Path) -> None:
    from torch._utils import ExceptionWrapper

    (tmp_path / "broken.JPG").write_bytes(b"not a jpeg")
    with pytest.raises(UserError) as raised:
        ResizedImages(PathImages([str(tmp_path / "broken.JPG")], [0]), 32)[0]
    expected = f"{tmp_path / 'broken.JPG'} is not a readable image"
    assert str(raised.value).startswith(expected)
    try:  # what the main process receives when a worker raised it
        ExceptionWrapper((UserError, raised.value, raised.tb), where="in DataLoader worker process 0").reraise()
    except UserError as rewrapped:
        assert "Traceback" in str(rewrapped)
        assert user_message(rewrapped) == str(raised.value)


# -------------------------------------------------------------------------------------- metrics


def test_macro_f1_top1_and_top3_match_scikit_learn_and_ignore_unknown_labels() -> None:
    classes = 5  # class 4 is neither a label nor a prediction: it counts as F1 0
    labels = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3, 0, -1])
    logits = torch.randn(len(labels), classes, generator=torch.Generator().manual_seed(0))
    logits[:, 4] -= 100
    metrics = TaxonomyMetrics({"species": classes}, {}, torch.device("cpu"))
    metrics.add_level("species", logits[:6], labels[:6])  # two batches: counts add up exactly
    metrics.add_level("species", logits[6:], labels[6:])
    result = metrics.compute("val")

    known = labels != -1
    y_true, scores = labels[known].numpy(), logits[known]
    y_pred = scores.argmax(1).numpy()
    expected_f1 = f1_score(y_true, y_pred, labels=range(classes), average="macro", zero_division=0)
    assert result["val/species/f1"] == pytest.approx(expected_f1, abs=1e-12)
    assert result["val/species/top1"] == pytest.approx((y_true == y_pred).mean())
    top3 = scores.topk(3, dim=1).indices.numpy()
    assert result["val/species/top3"] == pytest.approx(np.mean([t in row for t, row in zip(y_true, top3)]))
    assert expected_f1 != pytest.approx(f1_score(y_true, y_pred, average="macro", zero_division=0)), \
        "the fixed case must tell the label-space average from the present-classes average"


def test_hierarchy_consistency_on_a_hand_made_case() -> None:
    parents = {"genus": torch.tensor([0, 0, 1, 1]), "family": torch.tensor([0, 0, 1, 1])}
    metrics = TaxonomyMetrics({"species": 4, "genus": 2, "family": 2}, parents, torch.device("cpu"))
    metrics.add_consistency({
        "species": torch.tensor([0, 2, 3, 1]),  # parents: 0, 1, 1, 0
        "genus": torch.tensor([0, 0, 1, 0]),  # wrong for the second prediction
        "family": torch.tensor([0, 1, 1, 1]),  # wrong for the fourth
    })
    result = metrics.compute("val")
    assert result["val/genus/consistent_with_species"] == 0.75
    assert result["val/family/consistent_with_species"] == 0.75
    assert result["val/hierarchy_consistency"] == 0.5


def test_higher_ranks_derived_from_species_sum_the_species_probabilities() -> None:
    species_logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]]))
    derived = species_marginals(species_logits, torch.tensor([0, 0, 1, 1]), 2).exp()
    torch.testing.assert_close(derived, torch.tensor([[0.3, 0.7], [0.8, 0.2]]))


# --------------------------------------------------------------------------------------- model


def test_pretrained_weights_from_a_local_file_fill_the_backbone_and_species_head(tmp_path: Path) -> None:
    import timm

    published = timm.create_model("test_vit", num_classes=4, img_size=32)
    torch.save({"state_dict": published.state_dict()}, tmp_path / "fungi.pth")
    num_classes = {"species": 4, "genus": 2}
    model = build_model(ModelConfig(name="test_vit", drop_path_rate=0), num_classes, ["species", "genus"], 32,
                        pretrained=False)
    assert load_pretrained(model, str(tmp_path / "fungi.pth")) == "backbone and species head"
    for key, value in model.backbone.state_dict().items():
        torch.testing.assert_close(value, published.state_dict()[key], rtol=0, atol=0)
    torch.testing.assert_close(model.heads["species"].weight, published.head.weight, rtol=0, atol=0)

    other = timm.create_model("test_resnet", num_classes=4)
    torch.save(other.state_dict(), tmp_path / "other.pth")
    with pytest.raises(UserError, match="does not fit"):
        load_pretrained(model, str(tmp_path / "other.pth"))
    with pytest.raises(UserError, match=re.escape("is not here: run `make prep-fungitastic`")):
        load_pretrained(model, str(tmp_path / "absent.pth"))


@pytest.mark.slow
def test_prep_stores_the_pretrained_weights_and_the_run_reads_only_that_copy(fungi_data: Path,
                                                                             tmp_path: Path) -> None:
    """WEIGHTS=<a timm save_for_hf folder> is stored where model.pretrained points; the run (offline) uses it."""
    import timm
    from timm.models import save_for_hf

    torch.manual_seed(3)
    published = timm.create_model("test_vit", num_classes=4, img_size=32)
    published.pretrained_cfg = {**published.pretrained_cfg, "mean": (0.1, 0.2, 0.3), "std": (0.5, 0.5, 0.5)}
    save_for_hf(published, str(tmp_path / "download"), safe_serialization=True)
    stored = tmp_path / "weights" / "test_vit"
    setting = f"model.pretrained={stored}"
    result = prep(fungi_data, fungi_data, "--weights", str(tmp_path / "download"), weights=("model.name=test_vit",
                                                                                               setting))
    assert_ok(result)
    assert f"pretrained weights: {stored} ({tmp_path / 'download'})" in result.stdout
    assert sorted(path.name for path in stored.iterdir()) == ["config.json", "model.safetensors"]

    model_cfg = ModelConfig(name="test_vit", drop_path_rate=0, pretrained=str(stored))
    model = build_model(model_cfg, {"species": 4}, ["species"], 32)
    assert model.pretrained_parts == "backbone and species head"
    assert input_normalization(model_cfg, 32) == ((0.1, 0.2, 0.3), (0.5, 0.5, 0.5))
    torch.testing.assert_close(model.heads["species"].weight, published.head.weight, rtol=0, atol=0)

    run = run_recipe(RECIPE, overrides(fungi_data, tmp_path / "run", setting, "trainer.max_steps=1",
                                       "data.test_split=false"))
    assert_ok(run)
    assert f"pretrained backbone and species head from {stored}" in run.stdout


def test_weights_neither_here_nor_reachable_are_one_line_naming_the_prep_command(fungi_data: Path,
                                                                                 tmp_path: Path) -> None:
    absent = tmp_path / "data" / "weights" / "timm" / "test_vit.absent"
    run = run_recipe(RECIPE, overrides(fungi_data, tmp_path / "run", f"model.pretrained={absent}"))
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "make prep-fungitastic" in run.stderr

    offline = prep(fungi_data, fungi_data, weights=("model.name=test_vit", "model.pretrained=data/weights/timm/absent"))
    assert offline.returncode == 2 and offline.stderr.count("\n") == 1, offline.stderr
    assert "could not fetch timm/absent from the hub" in offline.stderr and "WEIGHTS=<dir or file>" in offline.stderr


# -------------------------------------------------------------------------------- end to end


def test_end_to_end_reports_every_rank_on_val_and_test(reference_run: tuple[Path, subprocess.CompletedProcess]) -> None:
    run_dir, result = reference_run
    summary = read_summary(run_dir)
    assert summary["steps"] == 3 * TRAIN_ROWS // 4
    assert summary["epochs"] == 3 and summary["resumes"] == 0 and summary["world_size"] == 1
    metrics = summary["metrics"]
    for split in ("val", "test"):
        assert metrics[f"{split}/samples"] == 8, "the unknown-species row is left out"
        for level in LEVELS:  # a count of hits over the 8 samples; top-3 holds every top-1 hit
            assert round(metrics[f"{split}/{level}/top1"] * 8, 9).is_integer()
            assert metrics[f"{split}/{level}/top1"] <= metrics[f"{split}/{level}/top3"]
        for level in ("class", "phylum"):  # one class: every prediction is right
            assert metrics[f"{split}/{level}/top1"] == metrics[f"{split}/{level}/f1"] == 1.0
        for level in LEVELS[1:]:
            assert f"{split}/{level}_from_species/f1" in metrics
        # Consistent with the species at every level means consistent in each: the joint rate is the lowest.
        joint = metrics[f"{split}/hierarchy_consistency"]
        assert joint <= min(metrics[f"{split}/{level}/consistent_with_species"] for level in LEVELS[1:])
        assert round(joint * 8, 9).is_integer()
    assert metrics["val/species/top1"] > 0.5, "each species has its own colour; training did not learn"
    assert summary["excluded_unknown_species"] == {"train": 0, "val": 1, "test": 1}
    assert "val: excluded 1 row(s) whose species is unknown (-1) from the closed-set metrics" in result.stdout
    best = run_dir / "checkpoints" / summary["best_checkpoint"]
    assert best.name.endswith("_force") and (best / "manifest.json").is_file()
    assert summary["best_metric"] == "val/species/f1"


@pytest.fixture(scope="session")
def fungi_data_one_val_image_missing(fungi_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The prepared data with one known-species val image deleted: 7 val rows, split 4 + 3 on 2 ranks."""
    data = tmp_path_factory.mktemp("fungi_missing") / "data"
    shutil.copytree(fungi_data, data, symlinks=False)
    val_csv = data / "metadata" / "FungiTastic-Mini" / "FungiTastic-Mini-Val.csv"
    known = pd.read_csv(val_csv).query("category_id != -1")
    (data / "FungiTastic-Mini" / "val" / "300p" / known["filename"].iloc[0]).unlink()
    for saved in (data / "prepared").rglob("*.index.npz"):  # listed before the image went: listed again
        saved.unlink()
    return data


@pytest.mark.slow
def test_sigkill_mid_epoch_then_a_stop_signal_then_resume_is_bit_exact(fungi_data_one_val_image_missing: Path,
                                                                       tmp_path: Path) -> None:
    """Two ranks, each loading with a worker (which must not change the augmentation, and must
    outlive the SIGTERM torchrun sends to its rank's process group): class-weighted losses, and 7
    val rows split unevenly, every metric equal to one rank's. (One process's SIGTERM and resume:
    make gpu-check, tests/test_gpu_check.py.)"""
    settings = [*RESUME_SETTINGS, "trainer.num_workers=1", "data.skip_missing=true",
                "loss.class_weighted_levels=[species,genus]"]
    summary = kill_signal_resume(RECIPE, overrides(fungi_data_one_val_image_missing, None, *settings), tmp_path, 2,
                                 signal.SIGTERM)
    assert summary["steps"] == 3 * TRAIN_ROWS // (4 * 2)
    assert summary["metrics"]["val/samples"] == 7 and summary["metrics"]["test/samples"] == 8
    assert summary["skipped_missing_images"] == {"train": 0, "val": 1, "test": 0}


def test_each_rank_evaluates_its_own_images_and_together_every_image_once(fungi_data_one_val_image_missing: Path,
                                                                         tmp_path: Path) -> None:
    """The recipe's evaluation loaders on 2 ranks yield, between them, exactly the images and
    labels of the 1-rank loader (7 rows: one rank gets 4, the other 3), each once."""
    from common.config import TrainerConfig
    from common.pytorch.distributed import DistInfo
    from recipes.fungitastic.config import FungiTasticConfig, ModelConfig
    from recipes.fungitastic.spec import SplitEvaluation

    data = fungi_data_one_val_image_missing
    cfg = FungiTasticConfig(data=DataConfig(root=str(data), prepared_dir=str(data / "prepared"), skip_missing=True,
                                            image_size=32),
                            model=ModelConfig(name="test_vit", pretrained=""),
                            trainer=TrainerConfig(eval_batch_size=2, num_workers=0))

    def samples(rank: int, world_size: int) -> list[tuple[bytes, tuple[int, ...]]]:
        info = DistInfo(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"),
                        launcher="single")
        return [(image.numpy().tobytes(), tuple(label.tolist()))
                for images, labels in SplitEvaluation(cfg, info, "val").loader
                for image, label in zip(images, labels)]

    everything = samples(0, 1)
    first, second = samples(0, 2), samples(1, 2)
    assert len(everything) == 7 and (len(first), len(second)) == (4, 3)
    assert len({image for image, _ in everything}) == 7, "the test images must tell the samples apart"
    assert sorted(first + second) == sorted(everything)


def test_a_bad_level_is_a_one_line_error_before_any_work(fungi_data: Path, tmp_path: Path) -> None:
    result = run_recipe(RECIPE, [*overrides(fungi_data, tmp_path / "run"), "data.levels=[species,kingdom]"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: data.levels names ['kingdom']; taxonomic_mappings.json has "
        "['species', 'genus', 'family', 'order', 'class', 'phylum']"]
    assert not (tmp_path / "run" / "checkpoints").exists()
