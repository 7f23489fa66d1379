"""dinov2_fsdp's linear-evaluation sweep (``probe.lrs``, ``probe.feature_variants``), as DINOv2's
eval/linear.py runs it: several heads on one frozen forward per batch, each at its own LR, each
evaluated, the best handed to the fine-tune. In-process probes of the tiny run (tests/recipe_probe.py);
the sharded case trains in this process on a process group of one (``fsdp.on_one_rank``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.pytorch.optim import scaled_lr
from tests.conftest import checkpoint_of_step
from tests.recipe_probe import Configs, probe, tiny_settings
from tests.trained_runs import train_here

RECIPE = "dinov2_fsdp"
PROBE_STEPS = 4  # 32 tiny images, global batch 8: one probe epoch
QUIET = ("logging.backend=none", "logging.progress_bar=false")


@pytest.fixture
def configs(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Configs:
    return Configs(RECIPE, tmp_path, [*tiny_settings(RECIPE, tmp_path_factory), *QUIET])


@pytest.fixture(scope="module")
def four_blocks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny transformers DINOv2 architecture with 4 blocks (``model.name``), randomly initialised:
    the last 4 blocks' class tokens exist."""
    from transformers import Dinov2Config

    path = tmp_path_factory.mktemp("dinov2_four_blocks")
    Dinov2Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, mlp_ratio=2, image_size=28,
                 patch_size=14).save_pretrained(path)
    return path


def test_one_probe_lr_is_the_plain_probe_and_ends_with_its_digest(configs: Configs) -> None:
    """``probe.lrs`` with one LR (that of ``optim.lr``) builds, trains and ends as a run without it:
    no probe heads, the same digest across the stage switch."""
    plain = probe(RECIPE, configs("trainer.epochs=2", "trainer.max_steps=5"), steps=None)
    one_lr = probe(RECIPE, configs("trainer.epochs=2", "trainer.max_steps=5", "probe.lrs=[0.05]"), steps=None)
    assert not any(key.startswith("probe_heads.") for key in one_lr.run.model.state_dict())
    assert one_lr.summary["model_digest"] == plain.summary["model_digest"]
    assert "probe_heads" not in one_lr.summary


def test_each_head_trains_as_alone_at_its_lr_on_one_backbone_forward(configs: Configs,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Each head has its own optimizer groups at its LR, and its losses are its own: the first two
    heads end the same whether a third trains beside them. The backbone runs once per micro-batch."""
    from transformers import Dinov2Model

    forwards = []
    original = Dinov2Model.forward
    monkeypatch.setattr(Dinov2Model, "forward", lambda self, *a, **k: forwards.append(1) or original(self, *a, **k))
    two = probe(RECIPE, configs("probe.lrs=[0.05,0.01]"), steps=2)
    assert len(forwards) == len(two.inputs) == 4  # 2 steps of 2 micro-batches: one backbone forward each
    three = probe(RECIPE, configs("probe.lrs=[0.05,0.01,0.002]"), steps=2)

    cfg = two.cfg
    scaled = [scaled_lr(lr, 8, cfg.trainer.lr_reference_batch_size, cfg.trainer.lr_scaling) for lr in (0.05, 0.01)]
    groups = [(group["initial_lr"], group["weight_decay"], len(group["params"]))
              for group in two.run.optimizer.param_groups]
    assert groups == [(scaled[0], 0.05, 1), (scaled[0], 0.0, 1), (scaled[1], 0.05, 1), (scaled[1], 0.0, 1)]
    two_heads, three_heads = two.run.model.probe_heads.heads, three.run.model.probe_heads.heads
    for index in range(2):
        assert not torch.equal(two_heads[index].weight, three_heads[2].weight)
        for name, param in two_heads[index].named_parameters():
            assert torch.equal(param, getattr(three_heads[index], name)), (index, name)
    assert not two.run.model.head.weight.requires_grad  # the classifier's head waits for the best


def _best(table: list[dict]) -> int:
    return max(range(len(table)), key=lambda index: (table[index]["top1"], -table[index]["loss"]))


def test_every_variant_is_evaluated_and_the_fine_tune_starts_from_the_best(
    configs: Configs, four_blocks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 LRs x DINOv2's 4 feature variants: 8 heads, a table of all in the progress, the best (top-1,
    then loss) placed in the classifier's head, which then computes its logits; the fine-tune's LR is
    stages.finetune_lr_ratio of the best head's."""
    from recipes.dinov2_fsdp.model import DinoClassifier

    taken = []
    original = DinoClassifier.take_probe_head

    def take(self: DinoClassifier, index: int) -> None:
        original(self, index)
        taken.append((index, self.head.weight.detach().clone(), self.head.bias.detach().clone(),
                      [(head.weight.detach().clone(), head.bias.detach().clone()) for head in self.probe_heads.heads],
                      list(self.probe_heads.columns)))

    monkeypatch.setattr(DinoClassifier, "take_probe_head", take)
    p = probe(RECIPE, configs("trainer.epochs=2", "model.pretrained=false", f"model.name={four_blocks}",
                              "model.features=cls4_patch_mean", "probe.lrs=[0.05,0.01]", "probe.feature_variants=true",
                              "stages.finetune_warmup_epochs=0"), steps=PROBE_STEPS + 1)
    table = p.held_progress.extra["probe"]["heads"]
    assert [(row["features"], row["lr"]) for row in table] == [
        (features, lr) for features in ("cls", "cls_patch_mean", "cls4", "cls4_patch_mean") for lr in (0.05, 0.01)]
    assert all({"loss", "top1", "top5"} <= set(row) for row in table)
    assert len({row["loss"] for row in table}) == 8  # each evaluated on its own
    best = _best(table)
    assert p.held_progress.extra["probe"]["best"] == best and [entry[0] for entry in taken] == [best]

    _, weight, bias, heads, columns = taken[0]
    assert torch.equal(weight[:, columns[best]], heads[best][0]) and torch.equal(bias, heads[best][1])
    assert weight.abs().sum() == heads[best][0].abs().sum()  # zero on the features the best head did not read
    assert columns[0] == slice(96, 128) and columns[-1] == slice(0, 160)  # cls: the last block's; cls4 + mean: all

    step, lr, optimizer = p.optimizer_steps[-1]
    cfg = p.cfg
    expected = scaled_lr(table[best]["lr"], 8, cfg.trainer.lr_reference_batch_size, cfg.trainer.lr_scaling)
    assert (step, optimizer) == (PROBE_STEPS + 1, 1) and lr == pytest.approx(expected * cfg.stages.finetune_lr_ratio)
    assert not p.run.model.probing and p.run.model.head.weight.requires_grad
    assert not any(param.requires_grad for param in p.run.model.probe_heads.parameters())


def test_a_stopped_sweep_resumes_with_its_heads_to_the_same_digest_and_table(configs: Configs) -> None:
    """Stopped mid-probe (the heads' weights and optimizer state in the checkpoint), then in the
    fine-tune (the best head, its table and the fine-tune's LR restored): the same digest and table."""
    settings = ("trainer.epochs=2", "probe.lrs=[0.05,0.01]", "checkpoint.every_steps=1", "checkpoint.every_seconds=0")
    whole = probe(RECIPE, configs(*settings), steps=None)
    first = probe(RECIPE, configs(*settings), steps=2)
    run_dir = f"run_dir={first.cfg.run_dir}"
    second = probe(RECIPE, configs(*settings, run_dir), steps=PROBE_STEPS + 2)
    third = probe(RECIPE, configs(*settings, run_dir), steps=None)
    assert (second.steps[0], third.steps[0]) == (2, PROBE_STEPS + 2)  # resumed at steps 1 and 5 (stage finetune)
    assert third.summary["model_digest"] == whole.summary["model_digest"]
    assert third.summary["probe_heads"] == whole.summary["probe_heads"]
    assert third.summary["probe_best"] == whole.summary["probe_best"] == ["cls_lr0.05", "cls_lr0.01"][
        _best(whole.summary["probe_heads"])]


def test_a_sharded_probe_only_sweep_ends_with_the_best_head_and_exports_without_the_others(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """FSDP2 (a group of one): a run that only probes hands its best head to the classifier, in
    the shards of its final checkpoint; an export holds the classifier alone."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from common.after_training.export import export_run
    from common.after_training.trained import open_run

    run_dir = tmp_path / "run"
    data = [setting for setting in tiny_settings(RECIPE, tmp_path_factory) if setting.startswith(("data.", "model.w"))]
    summary = train_here(RECIPE, run_dir, *data, *QUIET, "trainer.epochs=1", "fsdp.on_one_rank=true",
                         "probe.lrs=[0.05,0.01,0.002]")
    best = _best(summary["probe_heads"])
    assert summary["probe_best"] == summary["probe_heads"][best]["head"]
    assert summary["metrics"]["eval/top1"] == summary["probe_heads"][best]["top1"]
    dcp_to_torch_save(checkpoint_of_step(run_dir / "checkpoints", PROBE_STEPS) / "sharded", tmp_path / "whole.pt")
    state = torch.load(tmp_path / "whole.pt", weights_only=False)["model"]
    for name in ("weight", "bias"):
        assert torch.equal(state[f"head.{name}"], state[f"probe_heads.heads.{best}.{name}"]), name

    exported = export_run(open_run(run_dir), tmp_path / "export")
    names = set(load_file(exported / "model.safetensors"))
    assert {"classifier.weight", "classifier.bias"} <= names and not any("probe_heads" in name for name in names)


def test_under_fsdp2_the_best_head_is_written_to_the_shards_when_the_root_holds_gathered_weights(
    tmp_path: Path,
) -> None:
    """Before torch 2.14 an evaluation (a forward without gradients) leaves the FSDP2 root's weights
    gathered, and the module then holds those copies: the best head must still reach the shards."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import Dinov2Model

    from common.pytorch.fsdp import fully_shard_blocks
    from recipes.dinov2_fsdp.model import DinoClassifier, ProbeHead
    from tests.test_dinov2_fsdp import tiny_dinov2_config

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = DinoClassifier(Dinov2Model(tiny_dinov2_config()), "transformers", "cls",
                               [ProbeHead(0.05, "cls"), ProbeHead(0.01, "cls")])
        fully_shard_blocks(model, model.blocks, bf16_parameters=True, reshard_after_forward=True, cpu_offload=False)
        model.unshard()  # the root's weights gathered, as an evaluation leaves them before torch 2.14
        model.take_probe_head(1)
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    finally:
        dist.destroy_process_group()
    for name in ("weight", "bias"):
        assert torch.equal(state[f"head.{name}"], state[f"probe_heads.heads.1.{name}"]), name
    assert not torch.equal(state["head.weight"], state["probe_heads.heads.0.weight"])
