"""dinov2_fsdp on a tiny CIFAR-100 tarball with a tiny DINOv2: stages, FSDP2 resume, resharding.

The 2-rank runs are real ``torch.distributed.run`` launches on gloo (FSDP2 with bf16 parameters
on CPU). One uninterrupted 2-rank run with a checkpoint after every step is the reference that
several tests read: its checkpoints show the stage transition, its digest is what a killed and
resumed run must reproduce, and its step-6 checkpoint is what a single rank resumes from.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from common.checkpoint.layout import LATEST, committed_checkpoints
from common.checkpoint.manager import CheckpointManager
from tests.conftest import REPO, assert_ok, checkpoint_of_step, read_summary, recipe_env, run_recipe
from tests.resume import CHAIN_SETTINGS, kill_signal_resume
from tools.tiny_data import write_cifar100_tarball

RECIPE = "dinov2_fsdp"
N_TRAIN, N_TEST = 32, 11  # 11 test images: 2 ranks evaluate 6 and 5 of them
PROBE_STEPS, TOTAL_STEPS = 4, 12  # 32 images / global batch 8 = 4 steps per epoch; 1 probe + 2 fine-tune epochs


def tiny_dinov2_config():
    """Pretrained at 42 px (3x3 patches) and trained at 28 (2x2), as the published weights are
    pretrained at 518 px and trained at 224: the recipe resamples the position table once."""
    from transformers import Dinov2Config

    return Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2, image_size=42,
                        patch_size=14)


@pytest.fixture(scope="session")
def cifar_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The layout `make prep-cifar100_resnet50` leaves: data/cifar100/cifar-100-python/{train,test,meta}."""
    root = tmp_path_factory.mktemp("cifar100")
    tarball = write_cifar100_tarball(root / "cifar-100-python.tar.gz", n_train=N_TRAIN, n_test=N_TEST)
    with tarfile.open(tarball) as archive:
        archive.extractall(root, filter="data")
    return root


@pytest.fixture(scope="session")
def pretrained_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 'pretrained' backbone in transformers' save_pretrained layout (config.json + model.safetensors)."""
    from transformers import Dinov2Model

    torch.manual_seed(123)
    path = tmp_path_factory.mktemp("dinov2_tiny")
    Dinov2Model(tiny_dinov2_config()).save_pretrained(path)
    return path


def overrides(data: Path, backbone: Path | str, run_dir: Path | None, *extra: str) -> list[str]:
    return [
        f"data.root={data}", f"model.weights={backbone}", *([f"run_dir={run_dir}"] if run_dir else []),
        "model.image_size=28",
        "trainer.batch_size=4", "trainer.global_batch_size=8", "trainer.epochs=3", "stages.probe_epochs=1",
        "optim.lr=0.05", "trainer.log_every_steps=2", "checkpoint.every_seconds=0", "checkpoint.every_steps=1",
        "checkpoint.keep_last=100", "seed=3", "logging.backend=none", "logging.progress_bar=false",
        "trainer.deterministic=true", *extra,
    ]


@pytest.fixture(scope="session")
def reference(cifar_root: Path, pretrained_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-rank run (bf16 FSDP2) that keeps a checkpoint of every step."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    result = run_recipe(RECIPE, overrides(cifar_root, pretrained_dir, run_dir, *CHAIN_SETTINGS), nproc=2)
    assert_ok(result)
    (run_dir / "stdout.txt").write_text(result.stdout)
    return run_dir


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return checkpoint_of_step(run_dir / "checkpoints", step)


def saved_stage(run_dir: Path, step: int) -> str:
    state = torch.load(checkpoint_dir(run_dir, step) / "state.pt", weights_only=True)
    return state["progress"]["extra"]["stage"]


def shard_keys(run_dir: Path, step: int) -> set[str]:
    return set(FileSystemReader(checkpoint_dir(run_dir, step) / "sharded").read_metadata().state_dict_metadata)


def sharded_tensors(run_dir: Path, step: int, tmp_path: Path) -> dict:
    """The checkpoint's model and optimizer shards gathered into one state dict (no process group)."""
    out = tmp_path / f"gathered_{run_dir.parent.name}_{step}.pt"
    dcp_to_torch_save(checkpoint_dir(run_dir, step) / "sharded", out)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_probe_then_finetune_with_the_backbone_frozen_in_stage_one(
    reference: Path, pretrained_dir: Path, tmp_path: Path
) -> None:
    from transformers import Dinov2Model

    from recipes.dinov2_fsdp.model import fit_position_table

    summary = read_summary(reference)
    assert summary["steps"] == TOTAL_STEPS and summary["epochs"] == 3 and summary["world_size"] == 2
    assert summary["stage"] == "finetune"
    stdout = (reference / "stdout.txt").read_text()
    assert f"with FSDP2, global batch 8 (4 x 2 ranks x 1 accumulation), probe lr 0.05, {PROBE_STEPS} probe + " \
           f"{TOTAL_STEPS - PROBE_STEPS} fine-tune steps" in stdout
    assert f"stage finetune: backbone unfrozen, lr 0.00625 at step {PROBE_STEPS}" in stdout

    backbone = Dinov2Model.from_pretrained(pretrained_dir)
    fit_position_table(backbone, 28)  # as the recipe builds it: the table resampled to the training size
    pretrained = backbone.state_dict()
    end_of_probe = sharded_tensors(reference, PROBE_STEPS, tmp_path)
    first_finetune = sharded_tensors(reference, PROBE_STEPS + 1, tmp_path)

    # Stage 1: the backbone is exactly the pretrained one after 4 optimizer steps, the head moved,
    # and the optimizer holds state for the head only.
    assert saved_stage(reference, PROBE_STEPS) == "probe"
    for name, value in pretrained.items():
        assert torch.equal(end_of_probe["model"][f"backbone.{name}"], value), name
    probe_keys = {key for key in shard_keys(reference, PROBE_STEPS) if key.startswith("optimizer.state.")}
    assert probe_keys and all(key.startswith("optimizer.state.head.") for key in probe_keys), probe_keys
    assert not torch.equal(end_of_probe["model"]["head.weight"], sharded_tensors(reference, 1, tmp_path)["model"][
        "head.weight"])
    # The end of the probe is a milestone: _force, so the ISC ships it and retention keeps it.
    probe_end = checkpoint_dir(reference, PROBE_STEPS)
    assert probe_end.name.endswith("_force")
    assert json.loads((probe_end / "manifest.json").read_text())["milestone"] == "end of linear probe"

    # Stage 2: the whole backbone (but the unused mask token) trains with a fresh optimizer.
    assert saved_stage(reference, PROBE_STEPS + 1) == "finetune"
    finetune_state = first_finetune["optimizer"]["state"]
    trained = {name for name in pretrained if name != "embeddings.mask_token"}
    assert {f"backbone.{name}" for name in trained} | {"head.weight", "head.bias"} == set(finetune_state)
    assert all(int(state["step"]) == 1 for state in finetune_state.values())
    for name in trained:
        assert not torch.equal(first_finetune["model"][f"backbone.{name}"], pretrained[name]), name


@pytest.mark.slow
def test_sigkill_mid_epoch_then_a_stop_signal_then_resume_is_bit_exact(
    reference: Path, cifar_root: Path, pretrained_dir: Path, tmp_path: Path
) -> None:
    """Two ranks (FSDP2, sharded checkpoints): killed in the fine-tune stage, so the resume must
    restore the stage and its optimizer; the 11 test images split 6 + 5 score exactly as FSDP2 on
    one rank. (One process's SIGTERM and resume, without FSDP: make gpu-check,
    tests/test_gpu_check.py.)"""
    summary = kill_signal_resume(RECIPE, overrides(cifar_root, pretrained_dir, None), tmp_path, 2, signal.SIGTERM,
                                 reference=reference, first_kill=PROBE_STEPS + 1,
                                 one_rank_eval_overrides=("fsdp.on_one_rank=true",))
    assert summary["steps"] == TOTAL_STEPS and summary["stage"] == "finetune"


@pytest.mark.slow
def test_a_linear_sweep_killed_mid_probe_on_two_ranks_resumes_its_heads_and_ends_with_its_digest_and_table(
    cifar_root: Path, pretrained_dir: Path, tmp_path: Path
) -> None:
    """DINOv2's linear-evaluation sweep (``probe.lrs``, three heads) on two FSDP2 ranks, whose shards
    hold every head and its optimizer state: killed in the probe, stopped at its last step (the
    stage switch, which picks the best head) and resumed into the fine-tune, the run ends with the
    uninterrupted run's digest and head table; the probe's last checkpoint, evaluated on one rank,
    scores what the two ranks computed."""
    sweep = ["trainer.epochs=2", "probe.lrs=[0.05,0.01,0.002]"]
    summary = kill_signal_resume(RECIPE, overrides(cifar_root, pretrained_dir, None, *sweep), tmp_path, 2,
                                 signal.SIGTERM, extra_digests=("probe_heads", "probe_best"),
                                 one_rank_eval_overrides=("fsdp.on_one_rank=true",))
    assert summary["stage"] == "finetune" and len(summary["probe_heads"]) == 3
    assert summary["probe_best"] in {head["head"] for head in summary["probe_heads"]}


@pytest.mark.slow
def test_background_saves_of_the_shards_write_the_same_checkpoints(
    reference: Path, cifar_root: Path, pretrained_dir: Path, tmp_path: Path
) -> None:
    """checkpoint.async_save=true on 2 FSDP2 ranks: each rank's shards go to host memory and are
    written in the background (torch.distributed.checkpoint.async_save); the checkpoints are
    committed, verify, and hold what the synchronous reference run saved."""
    run_dir = tmp_path / "run"
    assert_ok(run_recipe(RECIPE, overrides(cifar_root, pretrained_dir, run_dir, "checkpoint.async_save=true"), nproc=2))
    assert read_summary(run_dir)["model_digest"] == read_summary(reference)["model_digest"]
    committed = committed_checkpoints(run_dir / "checkpoints")
    assert {found.step for found in committed} == set(range(1, TOTAL_STEPS + 1))
    manager = CheckpointManager(run_dir / "checkpoints")
    for found in committed:
        files = manager.verify(found.path)["files"]
        assert any(name.startswith("sharded/") for name in files), found.path
    assert checkpoint_dir(run_dir, PROBE_STEPS).name.endswith("_force")
    for step in (PROBE_STEPS, PROBE_STEPS + 1):
        written, expected = sharded_tensors(run_dir, step, tmp_path), sharded_tensors(reference, step, tmp_path)
        for name, value in expected["model"].items():
            assert torch.equal(written["model"][name], value), (step, name)
        assert written["optimizer"]["state"].keys() == expected["optimizer"]["state"].keys()


def copy_checkpoints_up_to(source: Path, destination: Path, step: int) -> None:
    """A run directory whose latest checkpoint is ``source``'s checkpoint ``step``."""
    (destination / "checkpoints").mkdir(parents=True)
    committed = committed_checkpoints(source / "checkpoints")
    latest = [found for found in committed if found.step == step][-1]
    for found in committed:
        if found.index <= latest.index:
            shutil.copytree(found.path, destination / "checkpoints" / found.path.name)
    (destination / "checkpoints" / LATEST).symlink_to(destination / "checkpoints" / latest.path.name)


@pytest.mark.slow
def test_a_checkpoint_of_two_ranks_resumes_on_one_rank(
    reference: Path, cifar_root: Path, pretrained_dir: Path, tmp_path: Path
) -> None:
    resume_at = PROBE_STEPS + 2

    # Loading the 2-rank shards on 1 rank and saving them again changes nothing: the model and the
    # fine-tune optimizer's state are resharded exactly (max_steps stops before any new step).
    exact = tmp_path / "exact"
    copy_checkpoints_up_to(reference, exact, resume_at)
    assert_ok(run_recipe(RECIPE, overrides(cifar_root, pretrained_dir, exact, f"trainer.max_steps={resume_at}")))
    original = sharded_tensors(reference, resume_at, tmp_path)
    resaved = sharded_tensors(exact, resume_at, tmp_path)
    assert saved_stage(exact, resume_at) == "finetune"
    assert original["model"].keys() == resaved["model"].keys()
    for name, value in original["model"].items():
        assert torch.equal(resaved["model"][name], value), name
    assert original["optimizer"]["state"].keys() == resaved["optimizer"]["state"].keys()
    for name, state in original["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(resaved["optimizer"]["state"][name][key], value), (name, key)

    # Continuing on 1 rank (2 micro-batches per step keep the global batch at 8) finishes the run.
    continued = tmp_path / "continued"
    copy_checkpoints_up_to(reference, continued, resume_at)
    result = run_recipe(RECIPE, overrides(cifar_root, pretrained_dir, continued))
    assert_ok(result)
    assert f"(step {resume_at}, epoch 1, stage finetune)" in result.stdout
    assert "global batch 8 (4 x 1 ranks x 2 accumulation)" in result.stdout
    summary = read_summary(continued)
    assert summary["world_size"] == 1 and summary["resumes"] == 1
    assert summary["steps"] == TOTAL_STEPS and summary["stage"] == "finetune"
    next_step = sharded_tensors(continued, resume_at + 1, tmp_path)["optimizer"]["state"]
    assert all(int(state["step"]) == resume_at + 1 - PROBE_STEPS for state in next_step.values())


def test_damaged_sharded_checkpoints_fall_back_to_the_newest_intact_one(
    reference: Path, cifar_root: Path, pretrained_dir: Path, tmp_path: Path
) -> None:
    """The two newest checkpoints' DCP files are damaged, each its own way (a byte of a shard
    flipped; the shards' metadata gone): the run names each and resumes from the one before them
    (on one rank here, resharding it), never from damaged shards."""
    run_dir, newest = tmp_path / "run", PROBE_STEPS + 3
    copy_checkpoints_up_to(reference, run_dir, newest)
    flipped = checkpoint_dir(run_dir, newest) / "sharded"
    shard = max(flipped.glob("*.distcp"), key=lambda path: path.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    dropped = checkpoint_dir(run_dir, newest - 1) / "sharded"
    (dropped / ".metadata").unlink()
    result = run_recipe(RECIPE, overrides(cifar_root, pretrained_dir, run_dir, f"trainer.max_steps={newest}"))
    assert_ok(result)
    assert (f"{flipped.parent} is damaged (sharded/{shard.name} does not match its sha256); trying the previous one"
            in result.stderr), result.stderr
    assert f"{dropped.parent} is damaged (sharded/.metadata is missing); trying the previous one" in result.stderr
    assert f"(step {newest - 2}, epoch 1, stage finetune)" in result.stdout
    assert read_summary(run_dir)["steps"] == newest


def test_missing_data_is_a_one_line_error_with_exit_2(pretrained_dir: Path, tmp_path: Path) -> None:
    result = run_recipe(RECIPE, overrides(Path("/does/not/exist"), pretrained_dir, tmp_path / "run"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: no CIFAR-100 pickles (train, test, meta) under /does/not/exist: run `make prep-cifar100_resnet50` "
        "or set data.root to the folder that holds cifar-100-python/"
    ]


# ---- in-process checks of the pieces -------------------------------------------------------------


@pytest.mark.parametrize(("num_samples", "world_size"), [(11, 2), (10, 2), (7, 3), (5, 1)])
def test_eval_batches_count_every_sample_once_with_equal_batches_per_rank(num_samples: int, world_size: int) -> None:
    from recipes.dinov2_fsdp.spec import eval_batches

    kept, batch_counts = [], set()
    for rank in range(world_size):
        batches = eval_batches(num_samples, rank, world_size, batch_size=2)
        batch_counts.add(tuple(len(indices) for indices, _ in batches))
        kept += [int(i) for indices, keep in batches for i in indices[keep]]
    assert len(batch_counts) == 1, "ranks would run different numbers of forward passes"
    assert sorted(kept) == list(range(num_samples))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("stages.probe_epochs=4", "stages.probe_epochs=4 must be between 0 and trainer.epochs=3"),
        ("trainer.precision=fp16", "trainer.precision=fp16 is not supported here"),
        ("fsdp.cpu_offload=true", "fsdp.cpu_offload moves GPU state to host memory: it needs device=cuda"),
        ("probe.lrs=[0.01,0.0]", "probe.lrs=[0.01, 0.0] must be distinct LRs above 0, one per head"),
        ("probe.lrs=[0.01,0.01]", "probe.lrs=[0.01, 0.01] must be distinct LRs above 0, one per head"),
        ("probe.lrs=[0.01,0.0100000001]", "probe.lrs=[0.01, 0.0100000001] must be distinct LRs above 0"),  # one name
        ("probe.lrs=[0.01,0.02] stages.probe_epochs=0", "probe.lrs and probe.feature_variants sweep the probe's "
                                                       "heads, and stages.probe_epochs=0 has no probe"),
        ("probe.feature_variants=true", "probe.feature_variants=true trains a head on each part of model.features, "
                                        "and model.features=cls has one: set model.features=cls_patch_mean, cls4"),
    ],
)
def test_settings_the_recipe_cannot_honour_are_refused(tmp_path: Path, override: str, message: str) -> None:
    from common.entry import compose_config
    from common.errors import UserError
    from common.pytorch.distributed import DistInfo
    from recipes.dinov2_fsdp.spec import check_settings

    cfg = compose_config(RECIPE, ["trainer.epochs=3", f"run_dir={tmp_path}", *override.split()])
    cpu = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="single")
    with pytest.raises(UserError, match=re.escape(message)):
        check_settings(cfg, cpu)


def _backbone(library: str, blocks: int) -> torch.nn.Module:
    """A tiny randomly initialised backbone of ``library`` with ``blocks`` transformer blocks (28 or 32 px)."""
    if library == "timm":
        import timm

        return timm.create_model("test_vit", pretrained=False, num_classes=0, img_size=32, depth=blocks)
    from transformers import Dinov2Model

    config = tiny_dinov2_config()
    config.num_hidden_layers, config.image_size = blocks, 28
    return Dinov2Model(config)


@pytest.mark.parametrize("library", ["transformers", "timm"])
def test_the_last_four_blocks_class_tokens_are_read_from_one_forward(library: str) -> None:
    """``model.features=cls4_patch_mean`` (DINOv2's n_last_blocks=4 with avgpool): the class tokens of
    the last 4 blocks, each through the final norm, then the last block's mean patch token; a backbone
    of fewer blocks is refused in one line."""
    from common.errors import UserError
    from recipes.dinov2_fsdp.model import DinoClassifier

    model = DinoClassifier(_backbone(library, 5), library, "cls4_patch_mean").eval()
    norm = model.backbone.layernorm if library == "transformers" else model.backbone.norm
    outputs = []
    for block in model.blocks:
        block.register_forward_hook(lambda module, args, output: outputs.append(
            output[0] if isinstance(output, tuple) else output))
    size = 28 if library == "transformers" else 32
    images = torch.randn(2, 3, size, size)
    with torch.no_grad():
        features = model.head_input(images)
        expected = [norm(output[:, 0]) for output in outputs[-4:]]
        expected.append(norm(outputs[-1])[:, model.num_prefix_tokens :].mean(dim=1))
    assert len(outputs) == 5  # one forward of the backbone
    assert features.shape == (2, 5 * model.embed_dim) and model.head.in_features == 5 * model.embed_dim
    torch.testing.assert_close(features, torch.cat(expected, dim=-1))
    with pytest.raises(UserError, match="model.features=cls4 reads the class tokens of the last 4 blocks, and this "
                                        "backbone has 3"):
        DinoClassifier(_backbone(library, 3), library, "cls4")


def test_transformers_architectures_build_offline_from_the_table() -> None:
    from recipes.dinov2_fsdp.config import ModelConfig
    from recipes.dinov2_fsdp.model import build_model

    model = build_model(ModelConfig(name="facebook/dinov2-small", pretrained=False, image_size=56,
                                    features="cls_patch_mean"))
    assert model.embed_dim == 384 and len(model.blocks) == 12 and model.head.in_features == 768
    assert model(torch.zeros(2, 3, 56, 56)).shape == (2, 100)


def test_the_position_table_is_resampled_once_to_the_training_size(pretrained_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights pretrained at 42 px, trained at 28: the table is resampled when the model is built
    and no forward interpolates it (its bicubic backward has no deterministic CUDA kernel); the
    model computes what transformers' per-forward interpolation computed."""
    from transformers import Dinov2Model

    from recipes.dinov2_fsdp.config import ModelConfig
    from recipes.dinov2_fsdp.model import build_model

    model = build_model(ModelConfig(weights=str(pretrained_dir), image_size=28)).eval()
    assert model.backbone.embeddings.position_embeddings.shape == (1, 2 * 2 + 1, 32)
    assert model.backbone.config.image_size == 28
    images = torch.randn(2, 3, 28, 28)
    interpolate, interpolations = torch.nn.functional.interpolate, []

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        interpolations.append(kwargs.get("mode"))
        return interpolate(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "interpolate", spy)
    with torch.no_grad():
        tokens = model.backbone(pixel_values=images).last_hidden_state
        assert interpolations == []
        expected = Dinov2Model.from_pretrained(pretrained_dir).eval()(pixel_values=images).last_hidden_state
    assert interpolations == ["bicubic"], "the pretrained model as transformers loads it interpolates per forward"
    torch.testing.assert_close(tokens, expected)


def test_timm_backbone_loads_a_local_weights_file_and_freezes(tmp_path: Path) -> None:
    import timm

    from recipes.dinov2_fsdp.config import ModelConfig
    from recipes.dinov2_fsdp.model import build_model

    torch.manual_seed(7)
    source = timm.create_model("test_vit", pretrained=False, num_classes=0, img_size=32)
    weights = tmp_path / "test_vit.pth"
    torch.save(source.state_dict(), weights)

    for features, width in (("cls", 64), ("cls_patch_mean", 128)):
        model = build_model(ModelConfig(library="timm", name="test_vit", pretrained=True, weights=str(weights),
                                        image_size=32, features=features))
        assert model.head.in_features == width and len(model.blocks) == len(source.blocks)
        for name, value in source.state_dict().items():
            assert torch.equal(model.backbone.state_dict()[name], value), name
        model.set_backbone_trainable(False)
        model(torch.randn(2, 3, 32, 32)).sum().backward()
        assert all(p.grad is None for p in model.backbone.parameters())
        assert model.head.weight.grad is not None


def test_timm_backbone_loads_a_timm_folder(tmp_path: Path) -> None:
    import timm
    from timm.models import save_for_hf

    from recipes.dinov2_fsdp.config import ModelConfig
    from recipes.dinov2_fsdp.model import build_model

    source = timm.create_model("test_vit", pretrained=False, num_classes=0, img_size=32)
    save_for_hf(source, str(tmp_path / "test_vit"), safe_serialization=True)
    model = build_model(ModelConfig(library="timm", name="test_vit", weights=str(tmp_path / "test_vit"),
                                    image_size=32))
    for name, value in source.state_dict().items():
        assert torch.equal(model.backbone.state_dict()[name], value), name


@pytest.mark.parametrize("weights", ["missing", ""], ids=["not_here", "hub_unreachable"])
def test_weights_neither_here_nor_reachable_are_one_line_naming_the_prep_command(
    cifar_root: Path, tmp_path: Path, weights: str
) -> None:
    setting = str(tmp_path / weights) if weights else ""
    result = run_recipe(RECIPE, overrides(cifar_root, setting, tmp_path / "run"))  # offline: HF_HUB_OFFLINE=1
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "make prep-dinov2_fsdp" in result.stderr


def test_prep_stores_the_backbone_from_a_local_copy_and_fails_in_one_line_offline(
    pretrained_dir: Path, cifar_root: Path, tmp_path: Path
) -> None:
    from transformers import Dinov2Model

    from data_prep.cifar100_resnet50 import TARBALL_MD5, VERIFIED_MARKER
    from data_prep.dinov2_fsdp import prepare_weights

    stored = tmp_path / "weights" / "dinov2-tiny"
    assert prepare_weights([f"model.weights={stored}"], pretrained_dir) == f"{stored} ({pretrained_dir})"
    expected = Dinov2Model.from_pretrained(pretrained_dir).state_dict()
    for name, value in Dinov2Model.from_pretrained(stored).state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert prepare_weights([f"model.weights={stored}"], None) == f"{stored} (already there)"
    assert prepare_weights(["model.pretrained=false"], None).startswith("none needed")

    # The whole script, in a fresh checkout's working directory, with the hub out of reach.
    workdir = tmp_path / "checkout"
    shutil.copytree(cifar_root, workdir / "data" / "cifar100")
    (workdir / "data" / "cifar100" / "cifar-100-python" / VERIFIED_MARKER).write_text(TARBALL_MD5 + "\n")
    offline = subprocess.run([sys.executable, "-m", "data_prep.dinov2_fsdp"], cwd=workdir, capture_output=True,
                             text=True, timeout=300, env=recipe_env(PYTHONPATH=str(REPO)))
    assert offline.returncode == 2 and offline.stderr.count("\n") == 1, offline.stderr
    assert "could not fetch facebook/dinov2-small from the hub" in offline.stderr
    assert "WEIGHTS=<dir or file>" in offline.stderr
    assert not (workdir / "data" / "weights" / "facebook" / "dinov2-small").exists()


def _init_mp_dtypes_before_torch_2_14(self) -> None:  # noqa: ANN001
    """``FSDPParamGroup._init_mp_dtypes`` as torch releases before 2.14 behave: a unit without
    trainable parameters gets no dtypes at all (2.14 falls back to all of its parameters)."""
    for fsdp_param in self.fsdp_params:
        fsdp_param.init_dtype_attrs(self.mp_policy)
    trainable = [fsdp_param for fsdp_param in self.fsdp_params if fsdp_param.sharded_param.requires_grad]
    self._orig_dtype = trainable[0].orig_dtype if trainable else None
    self._reduce_dtype = trainable[0].reduce_dtype if trainable else None


STAGE_SWITCHES = {"after-probe-steps": True, "resumed-at-the-switch": False}  # name: a probe step ran first


def _stage_switch_worker(rank: int, results: Path) -> None:
    """Both switches of :data:`STAGE_SWITCHES`, each on a model of its own, in this pair of ranks."""
    import torch.nn.functional as F
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from transformers import Dinov2Model

    from common.pytorch.fsdp import fully_shard_blocks
    from recipes.dinov2_fsdp.model import DinoClassifier, refresh_mixed_precision

    FSDPParamGroup._init_mp_dtypes = _init_mp_dtypes_before_torch_2_14
    for name, probe_forward_first in STAGE_SWITCHES.items():
        torch.manual_seed(0)
        model = DinoClassifier(Dinov2Model(tiny_dinov2_config()), "transformers", "cls")
        fully_shard_blocks(model, model.blocks, bf16_parameters=True, reshard_after_forward=True, cpu_offload=False)
        images, labels = torch.randn(4, 3, 28, 28), torch.randint(0, 100, (4,))
        model.set_backbone_trainable(False)
        if probe_forward_first:  # a probe step: FSDP sets its dtypes up with the backbone frozen
            F.cross_entropy(model(images).float(), labels).backward()
        model.set_backbone_trainable(True)
        refresh_mixed_precision(model)
        F.cross_entropy(model(images).float(), labels).backward()
        grads = {key: param.grad.dtype for key, param in model.named_parameters() if param.grad is not None}
        (results / f"{name}-rank{rank}.txt").write_text(f"{len(grads)} {sorted(set(map(str, grads.values())))}")


def test_finetune_after_the_probe_does_not_depend_on_fsdp_dtype_fallbacks(tmp_path: Path) -> None:
    """With bf16 FSDP2 units first run while frozen (after probe steps, or at once when resumed at
    the switch), the fine-tune backward still gives every parameter an fp32 gradient under torch
    releases without 2.14's dtype fallback (emulated)."""
    from transformers import Dinov2Model

    from recipes.dinov2_fsdp.model import NEVER_TRAINED, DinoClassifier
    from tests.conftest import spawn_ranks

    spawn_ranks(_stage_switch_worker, tmp_path)
    model = DinoClassifier(Dinov2Model(tiny_dinov2_config()), "transformers", "cls")
    trainable = sum(1 for name, _ in model.named_parameters() if name not in NEVER_TRAINED)
    for name in STAGE_SWITCHES:
        for rank in range(2):
            assert (tmp_path / f"{name}-rank{rank}.txt").read_text() == f"{trainable} ['torch.float32']", name
