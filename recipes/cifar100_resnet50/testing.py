"""What the shared tests need of cifar100_resnet50: its tiny settings and the checks of its own
config keys. A copy of the recipe (``make new-recipe``) carries it, so the copy is tested as this
one is with nothing to edit under ``tests/``; the names are read by ``tests/recipe_tables.py``,
which says what each one holds.
"""

IN_MEMORY = "no DataLoader: the whole dataset is a tensor on the device, batches are gathered by index"
RANDAUGMENT = ("data.auto_augment=randaugment",)
MULTISTEP = ("optim.sched=multistep",)

TINY = ["model.name=test_resnet", "trainer.precision=fp32", "trainer.batch_size=8"]
TINY_DATA = {"data.root": "cifar_data"}

KEY_CHECKS = {
    "data.random_crop_padding": ("first batch", "data.random_crop_padding=0"),
    "data.horizontal_flip": ("first batch", "data.horizontal_flip=false"),
    "data.rotation_degrees": ("first batch", "data.rotation_degrees=30"),
    "data.auto_augment": ("first batch", "data.auto_augment=trivialaugment"),
    "data.randaugment_ops": ("first batch", "data.randaugment_ops=1", RANDAUGMENT),
    "data.randaugment_magnitude": ("first batch", "data.randaugment_magnitude=3", RANDAUGMENT),
    "data.random_erasing": ("first batch", "data.random_erasing=1.0"),
    "model.name": ("weights", "model.name=resnet10t"),
    "model.cifar_stem": ("weights", "model.cifar_stem=false"),
    "model.drop_path_rate": ("first gradients", "model.drop_path_rate=0.5"),
    "optim.nesterov": ("optimizer", "optim.nesterov=false"),
    "optim.decay_norms_and_biases": ("optimizer", "optim.decay_norms_and_biases=true"),
    "optim.sched": ("lr schedule", "optim.sched=multistep"),
    "optim.milestones": ("lr schedule", "optim.milestones=[1,2]", MULTISTEP),
    "optim.gamma": ("lr schedule", "optim.gamma=0.5", MULTISTEP),
}

NO_EFFECT_ON_A_CPU = {"trainer.num_workers": IN_MEMORY}
