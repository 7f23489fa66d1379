"""Knowledge distillation (``distill.*``; ``common/after_training/distill.py``) in timm_imagenet,
cifar100_resnet50 and fungitastic, with the session's tiny trained runs (``tests/trained_runs.py``)
as teachers: what it changes and what it must leave alone."""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from common.after_training.distill import distilled, load_teacher, soft_target_loss
from common.after_training.export import export_run
from common.after_training.trained import open_run
from tests import trained_runs
from tests.recipe_probe import Configs, probe, tiny_settings
from tests.resume import kill_signal_resume

TEACHERS = {"cifar100_resnet50": trained_runs.cifar_run, "timm_imagenet": trained_runs.timm_run,
            "fungitastic": trained_runs.fungi_run}
SHORT = ("trainer.epochs=1", "trainer.max_steps=2")


def configs(recipe: str, factory: pytest.TempPathFactory) -> Configs:
    return Configs(recipe, factory.mktemp(f"{recipe}-distill"), tiny_settings(recipe, factory))


def saved_checkpoints(recipe: str, made: Configs, *overrides: str) -> Path:
    """The checkpoint folder of a fresh ``recipe`` model (no step taken): a cheap teacher."""
    seen = probe(recipe, made(*overrides))
    seen.run.save()
    return Path(seen.cfg.checkpoint.dir)


@pytest.mark.parametrize("recipe", sorted(TEACHERS))
def test_alpha_zero_ends_with_the_digest_of_a_run_without_a_teacher(recipe: str,
                                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    """The teacher runs (its forward on every batch) but weighs nothing: nothing it does may touch
    the student's weights, batches or random draws."""
    teacher = TEACHERS[recipe](tmp_path_factory)
    made = configs(recipe, tmp_path_factory)
    plain = probe(recipe, made(*SHORT), steps=None)
    distilling = probe(recipe, made(*SHORT, f"distill.teacher={teacher}", "distill.alpha=0"), steps=None)
    assert plain.error is None and distilling.error is None, (plain.error, distilling.error)
    assert distilling.summary["distill_teacher"]["source"] == str(teacher)
    assert "distill_teacher" not in plain.summary
    assert distilling.summary["model_digest"] == plain.summary["model_digest"]


def divergence(student: torch.nn.Module, teacher: torch.nn.Module, batch: torch.Tensor) -> float:
    """How far the student's outputs are from the teacher's on ``batch``."""
    with torch.no_grad():
        return float(soft_target_loss(student(batch), teacher(batch), 1.0))


def confident_teacher(factory: pytest.TempPathFactory) -> Path:
    """The tiny cifar run's export with its classifier's outputs made 10 times larger: predictions far
    from a fresh student's, which a few steps of distillation must bring it towards."""
    from safetensors.torch import load_file, save_file

    def make(folder: Path) -> Path:
        export = export_run(open_run(trained_runs.cifar_run(factory)), folder / "export")
        weights = load_file(str(export / "model.safetensors"))
        weights["fc.weight"], weights["fc.bias"] = weights["fc.weight"] * 10, weights["fc.bias"] * 10
        save_file(weights, str(export / "model.safetensors"), metadata={"format": "pt"})
        return export

    return trained_runs.shared_run("confident_cifar_teacher", factory, make)


def test_alpha_one_moves_the_students_outputs_towards_the_teachers(tmp_path_factory: pytest.TempPathFactory) -> None:
    recipe, teacher_source = "cifar100_resnet50", confident_teacher(tmp_path_factory)
    made = configs(recipe, tmp_path_factory)
    settings = ("trainer.epochs=3", "optim.lr=0.2", "optim.warmup_epochs=0", f"distill.teacher={teacher_source}")
    start = probe(recipe, made(*settings, "distill.alpha=0"), steps=1)  # one step barely moves the student
    teacher, batch = load_teacher(start.cfg, torch.device("cpu")).model, start.inputs[0]
    taught = probe(recipe, made(*settings, "distill.alpha=1"), steps=4)
    untaught = probe(recipe, made(*settings, "distill.alpha=0"), steps=4)
    assert taught.error is None and untaught.error is None
    after = divergence(taught.run.model, teacher, batch)
    assert after < 0.5 * divergence(untaught.run.model, teacher, batch)
    assert after < 0.5 * divergence(start.run.model, teacher, batch)


def test_the_loss_is_the_recipes_and_the_soft_target_loss_mixed_by_alpha(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The first step's loss with alpha 0.5 and T 2 is half the cross-entropy of a run without distillation
    and half T^2 KL(teacher || student) of the fresh student on the same batch (Mixup off)."""
    recipe, teacher_source = "cifar100_resnet50", confident_teacher(tmp_path_factory)
    made = configs(recipe, tmp_path_factory)
    settings = (*SHORT, f"distill.teacher={teacher_source}", "distill.temperature=2")
    fresh = probe(recipe, made(*settings))  # the student before its first step
    labels_only = probe(recipe, made(*settings, "distill.alpha=0"), steps=1)
    mixed = probe(recipe, made(*settings, "distill.alpha=0.5"), steps=1)
    batch = mixed.inputs[0]
    assert torch.equal(batch, labels_only.inputs[0]) and len(mixed.inputs) == 1
    teacher = load_teacher(mixed.cfg, torch.device("cpu")).model
    with torch.no_grad():
        soft = float(soft_target_loss(fresh.run.model(batch), teacher(batch), 2.0)) * len(batch)
    assert mixed.losses[0] == pytest.approx(0.5 * labels_only.losses[0] + 0.5 * soft, rel=1e-5)
    assert soft > 0.1 * labels_only.losses[0]  # a term large enough to tell the mix apart


@pytest.mark.parametrize("recipe", sorted(TEACHERS))
def test_the_teacher_sees_the_students_batch_after_mixup(recipe: str, tmp_path_factory: pytest.TempPathFactory,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """What the teacher's outputs were computed from is the student's input as its forward received it
    (augmented, mixed where the recipe mixes, normalised, in its memory format)."""
    made = configs(recipe, tmp_path_factory)
    teacher_source = saved_checkpoints(recipe, made, "seed=1")
    train = importlib.import_module(f"recipes.{recipe}.train")
    taught: list[Any] = []

    def recording(loss: torch.Tensor, student: Any, teacher: Any, *args: Any) -> torch.Tensor:
        taught.append(teacher)
        return distilled(loss, student, teacher, *args)

    monkeypatch.setattr(train, "distilled", recording)
    mixing = ("mixup.mixup_alpha=0.8",) if recipe != "fungitastic" else ()
    seen = probe(recipe, made(*SHORT, *mixing, f"distill.teacher={teacher_source}"), steps=1)
    assert seen.error is None and len(taught) == len(seen.inputs) == 1
    with torch.no_grad():
        expected = seen.run.teacher.model(seen.inputs[0])
    for name, outputs in (expected.items() if isinstance(expected, dict) else [("", expected)]):
        got = taught[0][name] if name else taught[0]
        torch.testing.assert_close(got, outputs, rtol=1e-5, atol=1e-6)


def test_the_teachers_forward_is_left_out_of_the_flops_behind_mfu(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``train/mfu`` is the student's: the FLOPs counted on the first step are those of a run without a
    teacher (the soft-target loss has no matrix products), though the teacher's forward ran inside it."""
    recipe = "cifar100_resnet50"
    made = configs(recipe, tmp_path_factory)
    plain = probe(recipe, made(*SHORT), steps=1)
    distilling = probe(recipe, made(*SHORT, f"distill.teacher={saved_checkpoints(recipe, made, 'seed=1')}"), steps=1)
    assert distilling.error is None
    assert distilling.run.progress.flops_per_sample == plain.run.progress.flops_per_sample > 0


def test_a_teacher_and_its_export_are_the_same_teacher(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Read from the run or from ``make export``'s folder alone: the same weights (the EMA), the same digest."""
    run = trained_runs.cifar_run(tmp_path_factory)
    export = export_run(open_run(run), tmp_path_factory.mktemp("cifar-export") / "export")
    made = configs("cifar100_resnet50", tmp_path_factory)
    from_run = load_teacher(made(f"distill.teacher={run}"), torch.device("cpu"))
    from_export = load_teacher(made(f"distill.teacher={export}"), torch.device("cpu"))
    assert from_run.digest == from_export.digest == trained_runs.summary(run)["ema_digest"]
    assert not any(parameter.requires_grad for parameter in from_export.model.parameters())
    assert not from_run.model.training


@pytest.mark.parametrize(("recipe", "teacher_of", "change", "expected"), [
    ("timm_imagenet", "timm_imagenet", ("data.root={renamed}",), "has other classes than this run (3 and 3, "),
    ("cifar100_resnet50", "timm_imagenet", (), "takes another input: mean [0.5, 0.5, 0.5], this run [0.5071"),
    ("timm_imagenet", "timm_imagenet", ("data.eval_size=24",), "takes another input: size [3, 32, 32], this run "
                                                                "[3, 24, 24]"),
    ("fungitastic", "fungitastic", ("data.levels=[species,genus]",), None),
    ("fungitastic", "timm_imagenet", (), "predicts output, and this run species"),
])
def test_a_teacher_of_other_classes_or_another_input_is_a_one_line_error_at_the_start(
        recipe: str, teacher_of: str, change: tuple[str, ...], expected: str | None,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """(A fungitastic student with fewer levels than its teacher distils the levels they share.)"""
    teacher = TEACHERS[teacher_of](tmp_path_factory)
    if "data.root={renamed}" in change:  # the tiny ImageFolder with one class folder renamed
        renamed = tmp_path_factory.mktemp("renamed") / "imagenet"
        shutil.copytree(trained_runs.imagenet_data(tmp_path_factory), renamed)
        for split in ("train", "val"):
            (renamed / split / "n01442764").rename(renamed / split / "n09999999")
            (renamed / f"{split}.index.npz").unlink()
        change = (f"data.root={renamed}",)
    seen = probe(recipe, configs(recipe, tmp_path_factory)(*change, f"distill.teacher={teacher}"))
    if expected is None:
        assert seen.error is None and seen.run.teacher is not None
        return
    assert seen.error is not None and expected in seen.error and "\n" not in seen.error, seen.error
    assert seen.error.startswith(f"distill.teacher={teacher} ")
    assert seen.run is None  # before any work: no run was made


@pytest.mark.parametrize(("change", "expected"), [
    (("distill.alpha=1.5",), "distill.alpha=1.5 must be between 0"),
    (("distill.temperature=0",), "distill.temperature=0.0 must be above 0"),
    ((), "distill.teacher={missing}: {missing} does not exist"),
])
def test_bad_distill_settings_are_one_line_errors(change: tuple[str, ...], expected: str, tmp_path: Path,
                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    missing = tmp_path / "missing"
    seen = probe("cifar100_resnet50", configs("cifar100_resnet50", tmp_path_factory)(*change,
                                                                                       f"distill.teacher={missing}"))
    assert seen.error is not None and "\n" not in seen.error
    assert seen.error.startswith(expected.format(missing=missing)), seen.error


def test_a_resume_checks_the_teacher_is_the_one_the_run_began_with(tmp_path_factory: pytest.TempPathFactory) -> None:
    recipe = "cifar100_resnet50"
    made = configs(recipe, tmp_path_factory)
    teacher = saved_checkpoints(recipe, made, "seed=1")
    other = saved_checkpoints(recipe, made, "seed=2")
    student = (*SHORT, f"run_dir={tmp_path_factory.mktemp('student')}")
    began = probe(recipe, made(*student, f"distill.teacher={teacher}"), steps=1)
    began.run.save()

    moved = teacher.parent / "moved"
    shutil.move(teacher, moved)  # the same weights elsewhere: the same teacher
    assert probe(recipe, made(*student, f"distill.teacher={moved}")).error is None
    shutil.move(other, teacher)  # other weights where the teacher was
    changed = probe(recipe, made(*student, f"distill.teacher={teacher}")).error
    assert changed is not None and "is not the teacher this run began with" in changed and "\n" not in changed
    assert "distill.teacher=" in probe(recipe, made(*student)).error  # resumed without one
    fresh = probe(recipe, made(*student, f"distill.teacher={teacher}", "checkpoint.resume=false"))
    assert fresh.error is None


@pytest.mark.slow
def test_sigkill_and_resume_of_a_distilling_run_ends_with_the_uninterrupted_digest(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A resume loads the teacher again from its path: the run ends as if never interrupted."""
    teacher = trained_runs.cifar_run(tmp_path_factory)
    data = trained_runs.cifar_data(tmp_path_factory)
    kill_signal_resume("cifar100_resnet50", [*trained_runs.TINY["cifar100_resnet50"], f"data.root={data}",
                                             "trainer.epochs=2", "mixup.mixup_alpha=0.8",
                                             f"distill.teacher={teacher}", "distill.temperature=2"], tmp_path)
