"""Knowledge distillation: a trained model (the teacher) whose soft outputs a new run also learns.

``distill.teacher=<run dir | checkpoint folder | checkpoint | export folder>`` in timm_imagenet,
cifar100_resnet50 and fungitastic (docs/after-training.md):

- :func:`load_teacher` loads it once at the start (the EMA where the run keeps one, as ``make export``
  takes), frozen, in evaluation mode, on the training device; a teacher of other classes or another
  input (size, normalisation) is a one-line error there.
- The recipe's loop runs it under ``torch.no_grad()`` on the student's batch, after Mixup, inside
  the student's autocast (the run's precision), and mixes its loss with :func:`distilled`.
- Checkpoints do not hold it: the run records its source and the digest of its weights
  (:meth:`Teacher.record`), and a resume loads it again and must find the same weights (:func:`check_resumed`).
- Multi-head models (fungitastic) distil every head the teacher shares with the student, the heads
  matched by name and their classes checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.after_training.export import is_export, load_export
from common.after_training.trained import LATEST, checkpoint_weights, open_run
from common.config import DistillConfig
from common.errors import UserError
from common.pytorch.distributed import on_device
from common.recipes import load_recipe
from common.records.summary import state_digest

SINGLE = "output"  # the name of a model's one output, where it is not a dict of heads


@dataclass
class Teacher:
    """A frozen model in evaluation mode on the training device, and what a resume checks of it."""

    model: nn.Module
    source: str  # distill.teacher as given
    digest: str  # sha256 of its weights (``state_digest``): the same for a run and its export
    description: str  # a line saying what was loaded

    def record(self) -> dict[str, str]:
        """What the run's progress keeps of it (checkpoints never hold the teacher itself)."""
        return {"source": self.source, "digest": self.digest}


def load_teacher(cfg: Any, device: torch.device) -> Teacher | None:
    """``cfg.distill.teacher``'s model, ready for the student of ``cfg``; None when distillation is off.

    - Raises a one-line :class:`UserError` for a bad ``distill.*`` value, a source that cannot be read,
      and a teacher whose classes or input differ from the student's.
    """
    distill: DistillConfig = cfg.distill
    if not distill.teacher:
        return None
    if not 0.0 <= distill.alpha <= 1.0:
        raise UserError(f"distill.alpha={distill.alpha} must be between 0 (the recipe's loss alone) and 1 "
                        f"(the teacher's soft targets alone)")
    if distill.temperature <= 0:
        raise UserError(f"distill.temperature={distill.temperature} must be above 0 (1 keeps the outputs as they are)")
    source = distill.teacher
    try:
        model, metadata, description = _trained_model(Path(source))
    except UserError as error:
        raise UserError(f"distill.teacher={source}: {error}") from error
    _check_fits(source, metadata, load_recipe(cfg.recipe).export_metadata(cfg))
    digest = state_digest(model.state_dict())
    model.requires_grad_(False)
    model = on_device(model.eval(), device, cfg.trainer.channels_last)
    return Teacher(model=model, source=source, digest=digest, description=description)


def _trained_model(path: Path) -> tuple[nn.Module, dict[str, Any], str]:
    """The model of an export folder or of a run's newest valid checkpoint (its EMA where kept), on the
    CPU; its export metadata (input, classes); a line saying what it is."""
    if is_export(path):
        model, metadata = load_export(path)
        return model, metadata, f"the {metadata['weights']} weights of the {metadata['recipe']} export {path}"
    run = open_run(path, LATEST)
    spec = load_recipe(run.recipe)
    metadata = spec.export_metadata(run.cfg)
    model = spec.model_from_export(run.cfg.model, metadata, run.run_dir)
    weights, kind = checkpoint_weights(run.checkpoint)
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:
        raise UserError(f"{run.checkpoint} does not fit the model its config builds: "
                        f"{str(error).strip().splitlines()[-1].strip()}") from error
    return model, metadata, f"the {kind} weights of {run.checkpoint} ({run.recipe}, step {run.manifest['step']})"


def output_classes(metadata: dict[str, Any]) -> dict[str, Any]:
    """Each output of a model and its classes, from its export metadata: fungitastic's taxonomic levels
    (``levels``, each level's names by index), or the one output of a classifier (``classes``)."""
    if "levels" in metadata:
        return {level: metadata["taxonomy"]["name_to_index"][level] for level in metadata["levels"]}
    return {SINGLE: metadata["classes"]}


def _check_fits(source: str, teacher: dict[str, Any], student: dict[str, Any]) -> None:
    """The teacher sees the student's training batches and is compared output by output: the same input
    size and normalisation, at least one output in common, and the same classes in each."""
    for key in ("size", "mean", "std"):
        if teacher["input"][key] != student["input"][key]:
            raise UserError(f"distill.teacher={source} takes another input: {key} {teacher['input'][key]}, this run "
                            f"{student['input'][key]}; distil from a model trained on inputs like this run's")
    theirs, ours = output_classes(teacher), output_classes(student)
    shared = [name for name in ours if name in theirs]
    if not shared:
        raise UserError(f"distill.teacher={source} predicts {', '.join(theirs)}, and this run "
                        f"{', '.join(ours)}: no output in common to distil")
    for name in shared:
        if theirs[name] != ours[name]:
            what = "" if name == SINGLE else f" at {name}"
            raise UserError(f"distill.teacher={source} has other classes{what} than this run ({len(theirs[name])} "
                            f"and {len(ours[name])}, or in another order): distil from a model trained on the "
                            f"same classes")


def check_resumed(recorded: dict[str, str], teacher: Teacher | None) -> None:
    """A resumed run distils from the teacher it began with (``recorded``: its :meth:`Teacher.record`, or
    empty): the same weights, wherever they are now. Raises a one-line :class:`UserError` otherwise."""
    if teacher is None and not recorded:
        return
    if teacher is None:
        raise UserError(f"this run began distilling from {recorded['source']}: resume it with "
                        f"distill.teacher={recorded['source']}, or start a new run (another name) without one")
    if not recorded:
        raise UserError(f"distill.teacher={teacher.source}: this run began without a teacher; start a new run "
                        f"(another name) to distil")
    if recorded["digest"] != teacher.digest:
        raise UserError(f"distill.teacher={teacher.source} is not the teacher this run began with ({recorded['source']}"
                        f", weights digest {recorded['digest'][:12]}, now {teacher.digest[:12]}): put that teacher "
                        f"back, or start a new run (another name)")


def soft_target_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """``T^2 * KL(teacher || student)`` of the outputs softened by ``T``, in fp32, averaged over the batch
    (Hinton et al.; the ``T^2`` keeps its gradients' scale as ``T`` changes)."""
    return F.kl_div(F.log_softmax(student.float() / temperature, dim=-1),
                    F.log_softmax(teacher.float() / temperature, dim=-1),
                    reduction="batchmean", log_target=True) * temperature**2


def distilled(loss: torch.Tensor, student: torch.Tensor | dict[str, torch.Tensor],
              teacher: torch.Tensor | dict[str, torch.Tensor], distill: DistillConfig,
              weights: dict[str, float] | None = None) -> torch.Tensor:
    """``(1 - alpha) * loss + alpha * <soft-target loss>``: the recipe's ``loss`` mixed with the teacher's
    soft targets, as DeiT and timm mix them.

    - Outputs that are dicts (heads by name): the soft-target losses of the heads both have, weighed by
      ``weights`` (a head without one weighs 1), as the recipe weighs its own per-head losses.
    """
    if isinstance(student, dict):
        soft = sum((weights or {}).get(head, 1.0) * soft_target_loss(student[head], teacher[head], distill.temperature)
                   for head in student if head in teacher)
    else:
        soft = soft_target_loss(student, teacher, distill.temperature)
    return (1 - distill.alpha) * loss + distill.alpha * soft
