# What make knows of this recipe beyond the pattern targets of the Makefile, which includes this file.
# Training and a search prepare the data first (it downloads or is Debian's package): a fresh clone's
# `make train-fashion_mnist` runs. `make new-recipe` copies this file with the recipe.
train-fashion_mnist search-fashion_mnist: prep-fashion_mnist
