"""What the shared tests need of dinov2_fsdp: its tiny settings and the checks of its own config
keys. A copy of the recipe (``make new-recipe``) carries it, so the copy is tested as this one is
with nothing to edit under ``tests/``; the names are read by ``tests/recipe_tables.py``, which
says what each one holds.
"""

IN_MEMORY = "no DataLoader: the whole dataset is a tensor on the device, batches are gathered by index"
FINE_TUNE = ("stages.probe_epochs=0",)  # starts in its fine-tune stage

TINY = ["model.image_size=28", "trainer.batch_size=4", "trainer.global_batch_size=8", "stages.probe_epochs=1",
        "optim.lr=0.05"]
TINY_DATA = {"data.root": "cifar_data", "model.weights": "dinov2_backbone"}

KEY_CHECKS = {
    "data.random_crop_padding": ("first batch", "data.random_crop_padding=0"),
    "data.horizontal_flip": ("first batch", "data.horizontal_flip=false"),
    "model.library": ("error", "model.library=timm"),  # timm knows no facebook/dinov2-small
    "model.name": ("weights", "model.name={dinov2_architecture}",
                   ("model.pretrained=false", "model.name={dinov2_backbone}")),
    "model.pretrained": ("weights", "model.pretrained=false"),
    "model.weights": ("weights", "model.weights={dinov2_weights}"),
    "model.image_size": ("first batch", "model.image_size=42"),
    "model.features": ("weights", "model.features=cls_patch_mean"),
    "fsdp.cpu_offload": ("error", "fsdp.cpu_offload=true"),  # offloads GPU state: refused on a CPU
    "stages.probe_epochs": ("optimizer", "stages.probe_epochs=0"),
    "stages.probe_warmup_epochs": ("lr schedule", "stages.probe_warmup_epochs=0.5"),
    "stages.finetune_lr_ratio": ("lr schedule", "stages.finetune_lr_ratio=0.5", FINE_TUNE),
    "stages.finetune_warmup_epochs": ("lr schedule", "stages.finetune_warmup_epochs=0", FINE_TUNE),
    "probe.lrs": ("optimizer", "probe.lrs=[0.05,0.01]"),  # a head, and its groups, per LR
    "probe.feature_variants": ("weights", "probe.feature_variants=true", ("model.features=cls_patch_mean",)),
}

NO_EFFECT_ON_A_CPU = {
    "trainer.num_workers": IN_MEMORY,
    "fsdp.reshard_after_forward": "FSDP2's memory against all-gather traffic on several ranks: the same numbers "
                                  "by design, and one process does not shard",
    "fsdp.on_one_rank": "FSDP2 in a process group of one, to check FSDP on one GPU (make gpu-check); the same "
                        "training by design, and a pytest process makes no process group",
}
