"""The shared layer: ``run/`` (the run contract every recipe's loop follows), ``records/`` (what a run
records), ``after_training/`` (a trained run evaluated, exported, trained from), ``checkpoint``,
``data/`` (input pipelines) and ``pytorch/`` (the PyTorch basics); ``entry`` starts a recipe's process.
There is deliberately no training loop: each recipe's ``train.py`` owns its loop. Imports only go
down the layers ``tests/test_layers.py`` lists."""
