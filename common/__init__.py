"""The shared layer, in three layers: the run lifecycle here (entry, the run contract, checkpoints,
what a run records, evaluation and export), input pipelines in ``data/``, the PyTorch basics in
``pytorch/``. There is deliberately no training loop: each recipe's ``train.py`` owns its loop."""
