"""What the shared tests need of fungitastic: its tiny settings and the checks of its own config
keys. A copy of the recipe (``make new-recipe``) carries it, so the copy is tested as this one is
with nothing to edit under ``tests/``; the names are read by ``tests/recipe_tables.py``, which
says what each one holds. (The keys of its data sources, ``data.format``, ``data.shards.*`` and
``data.rebuild_index``, have the checks every JPEG recipe shares, in tests/test_config_keys.py.)
"""

TINY = ["model.name=test_vit", "model.pretrained=", "model.drop_path_rate=0", "data.image_size=32",
        "trainer.batch_size=4", "trainer.precision=fp32", "trainer.num_workers=0", "optim.lr=0.001"]
TINY_DATA = {"data.root": "fungi_data"}
TINY_SHARDS = "fungi_shards"

KEY_CHECKS = {
    "data.prepared_dir": ("error", "data.prepared_dir={missing}"),
    "data.subset": ("error", "data.subset=full"),
    "data.size": ("error", "data.size=500p"),
    "data.minimal": ("sampler", "data.minimal=true"),
    "data.levels": ("weights", "data.levels=[species,genus]"),
    "data.image_size": ("first batch", "data.image_size=16"),
    "data.crop_scale_min": ("first batch", "data.crop_scale_min=0.3"),
    "data.randaugment_ops": ("first batch", "data.randaugment_ops=0"),
    "data.randaugment_magnitude": ("first batch", "data.randaugment_magnitude=5"),
    "data.horizontal_flip": ("first batch", "data.horizontal_flip=true"),
    "data.draft_decode": ("first batch", "data.draft_decode=false", ("data.image_size=16",)),
    "data.decode": ("first batch", "data.decode=gpu"),
    "data.skip_missing": ("error", "data.skip_missing=true", ("data.root={fungi_missing}",)),
    "data.test_split": ("final metrics", "data.test_split=false"),
    "model.name": ("weights", "model.name=test_vit2"),
    "model.pretrained": ("weights", "model.pretrained={fungi_weights}"),
    "model.drop_path_rate": ("first gradients", "model.drop_path_rate=0.5"),
    "model.head_dropout": ("first gradients", "model.head_dropout=0.5"),
    "model.derive_from_species": ("final metrics", "model.derive_from_species=true"),
    "loss.level_weights": ("first loss", "loss.level_weights.species=3.0"),
    # the tiny data's classes are balanced, so its class weights are equal: a file that weighs them differently
    "loss.class_weighted_levels": ("first loss", "loss.class_weighted_levels=[species]",
                                   ("data.prepared_dir={fungi_class_weights}",)),
    "fsdp.enabled": ("process group", "fsdp.enabled=true"),
    "fsdp.cpu_offload": ("process group", "fsdp.cpu_offload=true"),
    "optim.betas": ("optimizer", "optim.betas=[0.5,0.9]"),
    "optim.layer_decay": ("optimizer", "optim.layer_decay=0.65"),
}

NO_EFFECT_ON_A_CPU = {
    "fsdp.reshard_after_forward": "FSDP2's memory against all-gather traffic: the same numbers by design, and a "
                                  "pytest process makes no process group to shard in (FSDP2 trains on 1 and 2 gloo "
                                  "ranks in tests/test_fsdp.py)",
}
