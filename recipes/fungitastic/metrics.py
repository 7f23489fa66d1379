"""Per-level top-1, top-3 and macro-F1, hierarchy consistency, reduced exactly across ranks.

Every figure is computed from integer counts kept on the device (per-class true positives,
predictions and labels; correct top-k; consistent predictions), summed over ranks with one
all-reduce when read. Macro-F1 averages over every class of the label space: a class with no
label and no prediction in the split scores 0, as the FGVC library behind the published
FungiTastic baselines counts it (scikit-learn's ``f1_score(labels=range(C), average="macro",
zero_division=0)``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from recipes.fungitastic.metadata import UNKNOWN

TOP_K = 3


def class_counts(indices: torch.Tensor, counted: torch.Tensor, classes: int) -> torch.Tensor:
    """How often each class occurs in ``indices`` where ``counted`` is true. No host sync on CUDA:
    no ``bincount`` (it reads the output size back) and no boolean-mask indexing (the result's
    size depends on the data); entries not counted are added with weight 0 at index 0."""
    counts = torch.zeros(classes, dtype=torch.float64, device=indices.device)
    return counts.index_add_(0, torch.where(counted, indices, 0), counted.to(torch.float64))


def macro_f1(true_positives: torch.Tensor, predicted: torch.Tensor, actual: torch.Tensor) -> float:
    """Mean over classes of ``2 tp / (predicted + actual)``, 0 for a class with neither."""
    denominator = (predicted + actual).double()
    per_class = torch.where(denominator > 0, 2 * true_positives.double() / denominator.clamp(min=1), 0.0)
    return float(per_class.mean()) if per_class.numel() else float("nan")


class TaxonomyMetrics:
    """Counts for one evaluation pass over ``heads`` (name -> classes): ``add_*`` per batch (no
    host sync), ``compute`` once. Every counter exists from the start, so a rank that gets no
    sample of a small split still takes part in the reduction with zeros."""

    def __init__(self, heads: dict[str, int], parents: dict[str, torch.Tensor], device: torch.device) -> None:
        self.heads = dict(heads)
        self.parents = {level: table.to(device) for level, table in parents.items()}  # species -> parent per level
        self.device = device
        sizes = {"loss_sum": 1, "samples": 1}
        for name, classes in self.heads.items():
            sizes |= {f"{name}/count": 1, f"{name}/top1_hits": 1, f"{name}/top3_hits": 1,
                      f"{name}/tp": classes, f"{name}/predicted": classes, f"{name}/actual": classes}
        if self.parents:
            sizes |= {"consistent": 1, "predictions": 1} | {f"{level}/consistent": 1 for level in self.parents}
        self.counts = {name: torch.zeros(size, dtype=torch.float64, device=device) for name, size in sizes.items()}

    def _add(self, name: str, value: torch.Tensor) -> None:
        self.counts[name] += value.to(torch.float64)

    def add_loss(self, loss_sum: torch.Tensor, count: int) -> None:
        self._add("loss_sum", loss_sum.detach().reshape(1))
        self.counts["samples"] += count

    def add_level(self, name: str, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Top-1/top-3 hits and per-class counts of one head; labels of -1 are not counted."""
        classes = self.heads[name]
        valid = labels != UNKNOWN
        top = logits.topk(min(TOP_K, classes), dim=1).indices
        predicted = top[:, 0]
        hit = (predicted == labels) & valid
        self._add(f"{name}/count", valid.sum().reshape(1))
        self._add(f"{name}/top1_hits", hit.sum().reshape(1))
        self._add(f"{name}/top3_hits", ((top == labels[:, None]).any(1) & valid).sum().reshape(1))
        self._add(f"{name}/tp", class_counts(labels, hit, classes))
        self._add(f"{name}/predicted", class_counts(predicted, valid, classes))
        self._add(f"{name}/actual", class_counts(labels, valid, classes))

    def add_consistency(self, predictions: dict[str, torch.Tensor]) -> None:
        """Whether each higher-level prediction is the parent of the predicted species."""
        species = predictions["species"]
        consistent_all = torch.ones_like(species, dtype=torch.bool)
        for level, table in self.parents.items():
            consistent = predictions[level] == table[species]
            consistent_all &= consistent
            self._add(f"{level}/consistent", consistent.sum().reshape(1))
        self._add("consistent", consistent_all.sum().reshape(1))
        self.counts["predictions"] += len(species)

    def reduce(self) -> dict[str, torch.Tensor]:
        """The counts summed over every rank (collective: all ranks call it). One host sync."""
        names = sorted(self.counts)
        flat = torch.cat([self.counts[name] for name in names])
        if dist.is_initialized():
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        sizes = [self.counts[name].numel() for name in names]
        return dict(zip(names, flat.cpu().split(sizes)))

    def compute(self, prefix: str) -> dict[str, float]:
        """``{prefix}/loss``, ``{prefix}/samples``, ``{prefix}/{head}/top1``, ``top3``, ``f1`` and, with
        parents, ``{prefix}/hierarchy_consistency`` and ``{prefix}/{level}/consistent_with_species``;
        NaN where nothing was counted."""
        totals = self.reduce()

        def share(numerator: str, denominator: str) -> float:
            count = float(totals[denominator][0])
            return float(totals[numerator][0]) / count if count else float("nan")

        out = {f"{prefix}/loss": share("loss_sum", "samples"), f"{prefix}/samples": float(totals["samples"][0])}
        for name in self.heads:
            out[f"{prefix}/{name}/top1"] = share(f"{name}/top1_hits", f"{name}/count")
            out[f"{prefix}/{name}/top3"] = share(f"{name}/top3_hits", f"{name}/count")
            out[f"{prefix}/{name}/f1"] = macro_f1(totals[f"{name}/tp"], totals[f"{name}/predicted"],
                                                  totals[f"{name}/actual"])
        if self.parents:
            out[f"{prefix}/hierarchy_consistency"] = share("consistent", "predictions")
            for level in self.parents:
                out[f"{prefix}/{level}/consistent_with_species"] = share(f"{level}/consistent", "predictions")
        return out


def species_marginals(species_logits: torch.Tensor, parent: torch.Tensor, classes: int) -> torch.Tensor:
    """Log-probabilities of a higher level obtained by summing the species probabilities of each
    parent (species without a known parent are left out)."""
    probabilities = species_logits.float().softmax(dim=1)
    known = parent != UNKNOWN
    summed = torch.zeros(species_logits.shape[0], classes, device=species_logits.device)
    summed.index_add_(1, torch.where(known, parent, 0), probabilities * known)  # no boolean mask: no host sync
    return summed.clamp(min=1e-12).log()
