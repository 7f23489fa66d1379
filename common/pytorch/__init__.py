"""The PyTorch basics every recipe needs: process groups, exact metric reduction, optimizer and
precision settings, random streams, determinism, pretrained weight files (README "Layout")."""
