"""The PyTorch basics every recipe needs: process groups, metrics, optimizers, precision, RNG, weights."""
