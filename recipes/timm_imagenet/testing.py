"""What the shared tests need of timm_imagenet: its tiny settings and the checks of its own config
keys. A copy of the recipe (``make new-recipe``) carries it, so the copy is tested as this one is
with nothing to edit under ``tests/``; the names are read by ``tests/recipe_tables.py``, which
says what each one holds. (The keys of its data sources, ``data.format``, ``data.shards.*`` and
``data.rebuild_index``, have the checks every JPEG recipe shares, in tests/test_config_keys.py.)
"""

MULTISTEP = ("optim.sched=multistep",)
RANDOM_ERASING = ("data.re_prob=1.0",)

TINY = ["model.name=test_resnet", "data.train_size=32", "data.eval_size=32", "trainer.batch_size=8",
        "trainer.precision=fp32", "trainer.num_workers=0", "checkpoint.async_save=false"]
TINY_DATA = {"data.root": "imagenet_data"}
TINY_SHARDS = "imagenet_shards"

KEY_CHECKS = {
    "data.train_split": ("error", "data.train_split=missing"),
    "data.val_split": ("error", "data.val_split=missing"),
    "data.stage_to_local": ("train files", "data.stage_to_local=true", ("data.stage_dir={tmp}/a",)),
    "data.stage_dir": ("train files", "data.stage_dir={tmp}/b", ("data.stage_to_local=true", "data.stage_dir={tmp}/a")),
    "data.decode": ("first batch", "data.decode=gpu"),
    # libjpeg decodes at 1/2, 1/4 or 1/8 scale only when the crop is at least twice the output
    "data.draft_decode": ("first batch", "data.draft_decode=false", ("data.train_size=8", "data.scale=[1.0,1.0]")),
    "data.train_size": ("first batch", "data.train_size=24"),
    "data.eval_size": ("eval batches", "data.eval_size=24"),
    "data.eval_crop_pct": ("eval batches", "data.eval_crop_pct=0.5"),
    "data.interpolation": ("first batch", "data.interpolation=bicubic"),
    "data.scale": ("first batch", "data.scale=[0.5,0.6]"),
    "data.ratio": ("first batch", "data.ratio=[1.0,1.0]"),
    "data.hflip": ("first batch", "data.hflip=1.0", ("data.hflip=0.0",)),
    "data.color_jitter": ("first batch", "data.color_jitter=0.0"),
    "data.auto_augment": ("first batch", "data.auto_augment=rand-m9-mstd0.5"),
    "data.re_prob": ("first batch", "data.re_prob=1.0"),
    "data.re_mode": ("first batch", "data.re_mode=const", RANDOM_ERASING),
    "data.re_count": ("first batch", "data.re_count=3", RANDOM_ERASING),
    "data.repeated_augmentation": ("sampler", "data.repeated_augmentation=3"),
    "data.ra_selected_round": ("sampler", "data.ra_selected_round=16", ("data.repeated_augmentation=3",)),
    "model.name": ("weights", "model.name=test_efficientnet"),
    "model.pretrained_file": ("weights", "model.pretrained_file={timm_weights}"),
    "model.drop_rate": ("first gradients", "model.drop_rate=0.5"),
    "model.drop_path_rate": ("first gradients", "model.drop_path_rate=0.5"),
    "model.kwargs": ("weights", "+model.kwargs.zero_init_last=false"),
    "optim.opt": ("optimizer", "optim.opt=adamw"),
    "optim.opt_eps": ("optimizer", "optim.opt_eps=0.001", ("optim.opt=adamw",)),
    "optim.sched": ("lr schedule", "optim.sched=step"),
    "optim.warmup_epochs": ("lr schedule", "optim.warmup_epochs=1"),
    "optim.warmup_lr": ("lr schedule", "optim.warmup_lr=0.01"),
    "optim.min_lr": ("lr schedule", "optim.min_lr=0.01"),
    "optim.decay_epochs": ("lr schedule", "optim.decay_epochs=1", ("optim.sched=step",)),
    "optim.decay_milestones": ("lr schedule", "optim.decay_milestones=[1,2]", MULTISTEP),
    "optim.decay_rate": ("lr schedule", "optim.decay_rate=0.5", ("optim.sched=step", "optim.decay_epochs=1")),
    "fsdp.enabled": ("process group", "fsdp.enabled=true"),
    "fsdp.cpu_offload": ("process group", "fsdp.cpu_offload=true"),
    "optim.loss": ("first loss", "optim.loss=bce"),
    "optim.bce_target_thresh": ("first loss", "optim.bce_target_thresh=0.2", ("optim.loss=bce",)),
}

NO_EFFECT_ON_A_CPU = {
    "model.pretrained": "published weights from the Hugging Face hub, which a test never fetches "
                        "(model.pretrained_file, the local copy, is checked)",
    "fsdp.reshard_after_forward": "FSDP2's memory against all-gather traffic: the same numbers by design, and a "
                                  "pytest process makes no process group to shard in (FSDP2 trains on 1 and 2 gloo "
                                  "ranks in tests/test_fsdp.py)",
}
