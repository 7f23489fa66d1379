"""What the shared tests need of tv_segmentation: its tiny settings and the checks of its own
config keys. A copy of the recipe (``make new-recipe``) carries it, so the copy is tested as this
one is with nothing to edit under ``tests/``; the names are read by ``tests/recipe_tables.py``,
which says what each one holds.
"""

TINY = ["model.name=deeplabv3_mobilenet_v3_large", "data.base_size=40", "data.crop_size=40", "trainer.batch_size=2",
        "trainer.num_workers=0", "device=cpu"]
TINY_DATA = {"data.root": "voc_data"}

KEY_CHECKS = {
    "data.dataset": ("error", "data.dataset=coco"),
    "trainer.batch_size": ("first batch", "trainer.batch_size=4"),  # BatchNorm needs 2 or more
    "trainer.global_batch_size": ("run.plan.accumulate", "trainer.global_batch_size=4"),
    "data.train_split": ("error", "data.train_split=missing"),
    "data.val_split": ("error", "data.val_split=missing"),
    "data.base_size": ("first batch", "data.base_size=64"),
    "data.crop_size": ("first batch", "data.crop_size=32"),
    "data.min_scale": ("first batch", "data.min_scale=0.9"),
    "data.max_scale": ("first batch", "data.max_scale=1.0"),
    "data.hflip_prob": ("first batch", "data.hflip_prob=1.0", ("data.hflip_prob=0.0",)),
    "model.name": ("weights", "model.name=lraspp_mobilenet_v3_large", ("model.aux_loss=false",)),
    "model.num_classes": ("weights", "model.num_classes=16"),
    "model.aux_loss": ("weights", "model.aux_loss=false"),
    "model.aux_weight": ("first loss", "model.aux_weight=0.0"),
    "model.weights": ("weights", "model.weights={seg_weights}"),
    "model.weights_backbone": ("weights", "model.weights_backbone={seg_backbone}"),
    "model.sync_batchnorm": ("batchnorm on two ranks", "model.sync_batchnorm=false"),
    "optim.aux_lr_multiplier": ("optimizer", "optim.aux_lr_multiplier=2"),
    "optim.poly_power": ("lr schedule", "optim.poly_power=2"),
    "optim.warmup_start_factor": ("lr schedule", "optim.warmup_start_factor=0.5", ("optim.warmup_epochs=1",)),
}

NO_EFFECT_ON_A_CPU: dict[str, str] = {}
