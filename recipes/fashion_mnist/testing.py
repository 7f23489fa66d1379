"""What the shared tests need of fashion_mnist: its tiny settings and the checks of its own config
keys. A copy of the recipe (``make new-recipe``) carries it, so the copy is tested as this one is
with nothing to edit under ``tests/``; the names are read by ``tests/recipe_tables.py``, which
says what each one holds.
"""

# no DataLoader for the tiny data: its settings of a loader change nothing
IN_MEMORY = "no DataLoader: the whole dataset is a tensor on the device, batches are gathered by index"

# dropout on (the default has none): the shared tests check that a resumed or redone step draws its masks again
TINY = ["model.channels=[4,8]", "model.hidden=16", "model.dropout=0.25", "trainer.batch_size=16"]
TINY_DATA = {"data.root": "fashion_data"}

KEY_CHECKS = {
    "data.random_crop_padding": ("first batch", "data.random_crop_padding=4"),
    "data.horizontal_flip": ("first batch", "data.horizontal_flip=true"),
    "model.channels": ("weights", "model.channels=[4,4]"),
    "model.convs_per_block": ("weights", "model.convs_per_block=2"),
    "model.hidden": ("weights", "model.hidden=8"),
    "model.dropout": ("first gradients", "model.dropout=0.6"),
    "trainer.global_batch_size": ("run.plan.accumulate", "trainer.global_batch_size=32"),
    "optim.name": ("optimizer", "optim.name=sgd"),
    # one input channel is laid out alike in both formats: the model's weights show it
    "trainer.channels_last": ("weights", "trainer.channels_last=true", ("trainer.channels_last=false",)),
    "optim.momentum": ("optimizer", "optim.momentum=0.5", ("optim.name=sgd",)),
    # a Sequential of single layers has no blocks to checkpoint: refused in one line
    "trainer.activation_checkpointing": ("error", "trainer.activation_checkpointing=blocks"),
}

NO_EFFECT_ON_A_CPU = {"trainer.num_workers": IN_MEMORY}
