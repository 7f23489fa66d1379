"""``trainer.activation_checkpointing``: recomputing a block's activations in the backward pass changes
what the step keeps in memory, never what it computes.

Each recipe's real loop (``tests/recipe_probe.py``) takes its first optimizer step with the setting
off and on, in training mode with dropout and drop path drawing where the recipe has them: the
gradients the optimizer applied and everything the model holds after the step (weights, BatchNorm's
running statistics and batch count) are bit-identical. So the recomputation draws the same random
numbers as the forward pass, and BatchNorm does not count a batch twice. Memory and images/s with
and without it are measured on a GPU (``benchmarks/memory.py``).
"""

from __future__ import annotations

import pytest
import torch

from common.errors import UserError
from common.pytorch.activation_checkpointing import checkpoint_blocks, residual_blocks
from tests.recipe_probe import Configs, probe, tiny_settings

TRANSFORMER = {"blocks", "selective"}
CASES = {  # recipe: (settings with dropout or drop path on, the modes its blocks allow)
    "cifar100_resnet50": (["model.drop_path_rate=0.2"], {"blocks"}),
    "timm_imagenet": (["model.drop_path_rate=0.2"], {"blocks"}),
    "timm_imagenet-vit": (["model.name=test_vit", "+model.kwargs.img_size=32", "model.drop_path_rate=0.2",
                           "model.drop_rate=0.2"], TRANSFORMER),
    "tv_segmentation": ([], {"blocks"}),  # MobileNetV3's blocks: BatchNorm's running statistics
    "fungitastic": (["model.drop_path_rate=0.2", "model.head_dropout=0.2"], TRANSFORMER),
    "dinov2_fsdp": (["stages.probe_epochs=0"], TRANSFORMER),  # the fine-tune stage: the backbone trains
}


def first_step(recipe: str, configs: Configs, mode: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The gradients the first optimizer step applied, and the model's whole state after it."""
    seen = probe(recipe, configs(f"trainer.activation_checkpointing={mode}"), steps=1)
    assert seen.error is None, seen.error
    if mode != "none":
        assert any(hasattr(module, "_activation_checkpointing") for module in seen.run.model.modules())
    return seen.gradients[0], {name: value.clone() for name, value in seen.run.model.state_dict().items()}


@pytest.mark.parametrize("case", list(CASES))
def test_checkpointed_blocks_give_the_gradients_and_state_of_the_plain_model(
        case: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    recipe = case.split("-")[0]
    settings, modes = CASES[case]
    configs = Configs(recipe, tmp_path_factory.mktemp(case), [*tiny_settings(recipe, tmp_path_factory), *settings])
    plain_gradients, plain_state = first_step(recipe, configs, "none")
    for mode in sorted(modes):
        gradients, state = first_step(recipe, configs, mode)
        assert gradients.keys() == plain_gradients.keys()
        for name, value in plain_gradients.items():
            assert torch.equal(gradients[name], value), f"{case}, {mode}: the gradient of {name} differs"
        for name, value in plain_state.items():
            assert torch.equal(state[name], value), f"{case}, {mode}: {name} differs after the step"


def test_the_blocks_are_the_repeated_units_and_a_model_without_them_is_refused() -> None:
    import timm
    import torchvision

    resnet = timm.create_model("resnet18", num_classes=3)  # its stem convolution is no block
    assert [type(block).__name__ for block in residual_blocks(resnet)] == ["BasicBlock"] * 8
    vit = timm.create_model("test_vit", num_classes=3)
    assert residual_blocks(vit) == list(vit.blocks)
    backbone = torchvision.models.get_model("deeplabv3_resnet50", num_classes=3, weights_backbone=None).backbone
    assert {type(block).__name__ for block in residual_blocks(backbone)} == {"Bottleneck"}
    with pytest.raises(UserError, match="has no blocks to checkpoint"):
        checkpoint_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), "blocks")
    with pytest.raises(UserError, match="convolutional: use blocks"):
        checkpoint_blocks(resnet, "selective")
