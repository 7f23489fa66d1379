"""Copy a recipe as the start of a new one: ``make new-recipe NAME=x [FROM=fashion_mnist]``.

What it copies (``y`` is FROM, ``x`` is NAME; a file that is not there is skipped):

  recipes/y/ (every file)        -> recipes/x/   the loop, schema, data, model, spec.py, README.md,
                                                  and testing.py: what the shared tests need of it
  conf/y.yaml                    -> conf/x.yaml
  conf/experiment/y_*.yaml       -> conf/experiment/x_*.yaml   (presets named otherwise stay shared:
                                                                 +experiment=<name> works with the copy)
  conf/search/y.yaml             -> conf/search/x.yaml
  data_prep/y.py                 -> data_prep/x.py
  tests/test_y.py, test_y_*.py   -> tests/test_x.py, test_x_*.py
  (a y_* or test_y_* file of another recipe, one named y_<more>, is not copied)
  cluster/slurm/y.sbatch         -> cluster/slurm/x.sbatch
  cluster/isc/y.isc              -> cluster/isc/x.isc

What it rewrites, in every copied file: ``y`` becomes ``x`` wherever no letter, digit or
underscore comes just before it (module paths ``recipes.y.train``, config names ``y_schema``,
``recipe: str = "y"``, ``make train-y``, file names), and the CamelCase prefix of y's config
classes (``FashionMNIST`` in ``class FashionMNISTConfig(RunConfig)`` of ``recipes/y/config.py``)
becomes x's CamelCase name (``MyRecipe`` for ``my_recipe``) where a capital letter follows it and
none of those comes before it. Prose that names the dataset (``Fashion-MNIST``) and names in which
``y`` follows such a character (``write_fashion_mnist``, the tiny-data writer the tests share) stay
as they are.

``recipes/y/recipe.mk``, which the Makefile includes, is copied with the rest: where
``make train-y`` prepares its data first (``train-y: prep-y``), ``make train-x`` does too. The
command's last lines name every command the copy needs, in order.

Nothing else is written and nothing existing is overwritten: the shared test tables
(``tests/test_config_keys.py``, ``tests/trained_runs.py``) read the copy's ``recipes/x/testing.py``,
and the Makefile finds every ``recipes/*/train.py``, so the copy's tests and the suite's checks of
every recipe pass as they are. When x's schema gains a key, its check goes in ``recipes/x/testing.py``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]*$")


def camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def class_prefix(source_dir: Path, name: str) -> str | None:
    """The CamelCase prefix of the source's config classes (``FashionMNIST`` in ``FashionMNISTConfig``)."""
    config = source_dir / "config.py"
    if config.is_file():
        match = re.search(r"class (\w+)Config\(RunConfig\)", config.read_text())
        if match:
            return match.group(1)
    return camel(name)


def named_after(stem: str, source: str, repo: Path) -> bool:
    """Whether ``stem`` (``<source>`` or ``<source>_<more>``) is named after ``source`` and not after
    another recipe whose name starts with it (``<source>_v2``'s files are not ``source``'s)."""
    others = [path.parent.name for path in (repo / "recipes").glob(f"{source}_*/train.py")]
    return not any(stem == other or stem.startswith(f"{other}_") for other in others)


def files_to_copy(repo: Path, source: str, target: str) -> list[tuple[Path, Path]]:
    """``(source file, its copy)`` for every file the module's docstring lists."""
    def renamed(path: Path) -> Path:
        return path.with_name(path.name.replace(source, target, 1))

    pairs = []
    for path in sorted((repo / "recipes" / source).rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            pairs.append((path, repo / "recipes" / target / path.relative_to(repo / "recipes" / source)))
    experiments = [path for path in sorted((repo / "conf" / "experiment").glob(f"{source}_*.yaml"))
                   if named_after(path.stem, source, repo)]
    for path in (repo / "conf" / f"{source}.yaml", *experiments, repo / "conf" / "search" / f"{source}.yaml",
                 repo / "data_prep" / f"{source}.py"):
        if path.is_file():
            pairs.append((path, renamed(path)))
    for path in sorted([*(repo / "tests").glob(f"test_{source}.py"), *(repo / "tests").glob(f"test_{source}_*.py")]):
        if named_after(path.stem.removeprefix("test_"), source, repo):
            pairs.append((path, renamed(path)))
    for folder, suffix in (("slurm", ".sbatch"), ("isc", ".isc")):
        cluster_file = repo / "cluster" / folder / f"{source}{suffix}"
        if cluster_file.is_file():
            pairs.append((cluster_file, renamed(cluster_file)))
    return pairs


def copy_recipe(repo: Path, source: str, target: str) -> list[Path]:
    if not NAME_PATTERN.match(target):
        raise ValueError(f"NAME must be a Python identifier in lower case (like my_recipe), not {target!r}")
    if not (repo / "recipes" / source / "train.py").is_file():
        raise ValueError(f"there is no recipe {source!r} to copy (recipes/{source}/train.py is missing)")
    pairs = files_to_copy(repo, source, target)
    existing = [str(dst.relative_to(repo)) for _, dst in pairs if dst.exists()]
    if existing:
        raise ValueError(f"recipe {target!r} already exists ({existing[0]}); choose another NAME")
    old_prefix, new_prefix = class_prefix(repo / "recipes" / source, source), camel(target)
    written = []
    for src, dst in pairs:
        dst.parent.mkdir(parents=True, exist_ok=True)
        text = src.read_text()
        text = re.sub(rf"\b{re.escape(source)}", target, text)
        if old_prefix:
            text = re.sub(rf"\b{re.escape(old_prefix)}(?=[A-Z]\w*)", new_prefix, text)
        dst.write_text(text)
        shutil.copymode(src, dst)
        written.append(dst)
    return written


def prepares_its_data(repo: Path, name: str) -> bool:
    """Whether ``make train-<name>`` runs ``make prep-<name>`` first: a rule of ``recipes/<name>/recipe.mk``
    (which the Makefile includes) that gives ``train-<name>`` the prerequisite ``prep-<name>``."""
    declaration = repo / "recipes" / name / "recipe.mk"
    if not declaration.is_file():
        return False
    for line in declaration.read_text().splitlines():
        targets, colon, prerequisites = line.partition(":")
        if colon and not line.startswith(("#", "\t")) and f"train-{name}" in targets.split() \
                and f"prep-{name}" in prerequisites.split():
            return True
    return False


def next_commands(repo: Path, name: str) -> list[str]:
    """The commands a copy needs, in the order to run them: its data (where its training does not
    prepare it), its training, its tests."""
    commands = []
    if prepares_its_data(repo, name):
        train = f"make train-{name}      # prepares its data first (make prep-{name}), as its original does"
    else:
        if (repo / "data_prep" / f"{name}.py").is_file():
            commands.append(f"make prep-{name}      # its data (SOURCE=<a local copy>: "
                            f"python -m data_prep.{name} --help)")
        train = f"make train-{name}"
    return [*commands, train,
            f"make test PYTEST_ARGS=\"tests/test_{name}.py tests/test_config_keys.py -k {name}\""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True, help="the new recipe's name (lower_case)")
    parser.add_argument("--from", dest="source", default="fashion_mnist", help="the recipe to copy")
    args = parser.parse_args()
    try:
        written = copy_recipe(REPO, args.source, args.name)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    for path in written:
        print(f"  created {path.relative_to(REPO)}")
    name, source = args.name, args.source
    classes = f"{class_prefix(REPO / 'recipes' / source, source)}... became {camel(name)}..."
    print(f"\nnew recipe {name!r}, copied from {source!r}: in these {len(written)} files {source} became {name} "
          f"and {classes}\n(`python -m tools.new_recipe --help` says exactly where); nothing else was written.\n"
          f"Its tests pass as they are, and so do the suite's checks of every recipe, which read\n"
          f"recipes/{name}/testing.py (its tiny test settings and the checks of its config keys).\n"
          f"What it takes to train and test it, in order:")
    for command in next_commands(REPO, name):
        print(f"  {command}")
    print(f"When you add a key to recipes/{name}/config.py, give it a check in recipes/{name}/testing.py.")


if __name__ == "__main__":
    main()
