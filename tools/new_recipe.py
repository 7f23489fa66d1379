"""Copy a recipe as the start of a new one: ``make new-recipe NAME=x [FROM=fashion_mnist]``.

Copies ``recipes/<from>/``, ``conf/<from>.yaml``, ``conf/experiment/<from>_*.yaml``, the search
space ``conf/search/<from>.yaml``, ``data_prep/<from>.py``, ``tests/test_<from>*.py`` and the cluster files
``cluster/slurm/<from>.sbatch`` and ``cluster/isc/<from>.isc`` (every recipe has both, and the
suite checks that), renaming the recipe everywhere in them (module paths, config and schema
names, class-name prefixes), so the copy's tests pass as they are. The whole suite then asks for
checks of the new schema's keys (``tests/test_config_keys.py``, docs/adding-a-recipe.md). Nothing
existing is overwritten.
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


def files_to_copy(repo: Path, source: str, target: str) -> list[tuple[Path, Path]]:
    pairs = []
    for path in sorted((repo / "recipes" / source).rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            pairs.append((path, repo / "recipes" / target / path.relative_to(repo / "recipes" / source)))
    pairs.append((repo / "conf" / f"{source}.yaml", repo / "conf" / f"{target}.yaml"))
    for path in sorted((repo / "conf" / "experiment").glob(f"{source}_*.yaml")):
        pairs.append((path, path.with_name(path.name.replace(source, target, 1))))
    space = repo / "conf" / "search" / f"{source}.yaml"
    if space.is_file():
        pairs.append((space, space.with_name(f"{target}.yaml")))
    prep = repo / "data_prep" / f"{source}.py"
    if prep.is_file():
        pairs.append((prep, repo / "data_prep" / f"{target}.py"))
    for path in sorted((repo / "tests").glob(f"test_{source}*.py")):
        pairs.append((path, path.with_name(path.name.replace(source, target, 1))))
    for folder, suffix in (("slurm", ".sbatch"), ("isc", ".isc")):
        cluster_file = repo / "cluster" / folder / f"{source}{suffix}"
        if cluster_file.is_file():
            pairs.append((cluster_file, cluster_file.with_name(f"{target}{suffix}")))
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
    print(f"\nnew recipe {args.name!r}: try `make test PYTEST_ARGS=tests/test_{args.name}.py` "
          f"and `make train-{args.name}`; then give its config keys their checks in tests/test_config_keys.py "
          f"(start from {args.source}'s) and its tiny settings in tests/trained_runs.py")


if __name__ == "__main__":
    main()
