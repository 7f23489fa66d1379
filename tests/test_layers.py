"""The import direction of ``common/``, and the recipes' independence, read from the source.

Every import counts, a function's lazy one too: a module may import its own layer and the layers
below it, never one above. What sits where:

======  ======================================================================================
layer   modules
======  ======================================================================================
0       ``common.errors``, ``common.jsonfiles``, ``common.config``: names and files, no torch state
1       ``common.pytorch``: the PyTorch basics
2       ``common.data``: input pipelines
3       ``common.recipes`` (a recipe's spec), ``common.checkpoint``
4       ``common.records``: what a run records
5       ``common.run_lock``, ``common.entry``: one process of a run
6       ``common.after_training``: a trained run opened, evaluated, exported, trained from
7       ``common.run``: the run itself, which starts from another run's weights (``init_from``)
======  ======================================================================================

``common`` imports nothing of ``recipes``, ``cluster``, ``tools``, ``benchmarks`` or ``tests``, and no
recipe imports another.

No module of the project imports itself through others (a circle, lazy imports included): a circle
makes the order of imports matter, and ``python -m`` of a module in one loads that module twice.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = (
    ("common.errors", "common.jsonfiles", "common.config"),
    ("common.pytorch",),
    ("common.data",),
    ("common.recipes", "common.checkpoint"),
    ("common.records",),
    ("common.run_lock", "common.entry"),
    ("common.after_training",),
    ("common.run",),
)
OUTSIDE_COMMON = ("recipes", "cluster", "tools", "benchmarks", "tests")
PACKAGES = ("common", "recipes", "data_prep", "cluster", "tools", "benchmarks", "tests")


def module_name(path: Path, repo: Path = REPO) -> str:
    parts = list(path.relative_to(repo).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function (``from a import b`` gives
    ``a`` and ``a.b``: ``b`` may be a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def layer_of(module: str) -> int | None:
    """The layer of a module of ``common``, by its longest matching package; None for ``common`` itself."""
    matches = [(len(prefix), index) for index, prefixes in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    return max(matches)[1] if matches else None


def common_modules() -> list[Path]:
    return sorted((REPO / "common").rglob("*.py"))


def import_graph(repo: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Each module of ``packages`` under ``repo`` -> the modules of those packages it imports."""
    paths = [path for package in packages for path in sorted((repo / package).rglob("*.py"))]
    modules = {module_name(path, repo): path for path in paths}
    return {module: {name for name in imported_modules(path) if name in modules and name != module}
            for module, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that import each other, directly or through others: each group sorted
    (Tarjan's strongly connected components of more than one module)."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = lowest[module] = len(index)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                lowest[module] = min(lowest[module], lowest[imported])
            elif imported in stack:
                lowest[module] = min(lowest[module], index[imported])
        if lowest[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def test_no_module_imports_itself_through_others() -> None:
    found = circles(import_graph(REPO, PACKAGES))
    assert not found, f"{len(found)} import circle(s): " + "; ".join(" <-> ".join(group) for group in found)


def test_the_check_sees_a_circle_closed_by_a_lazy_import(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import B\n")
    (tmp_path / "pkg" / "b.py").write_text("def late():\n    from pkg import a\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\n")
    assert circles(import_graph(tmp_path, ("pkg",))) == [["pkg.a", "pkg.b"]]


def test_every_module_of_common_has_a_layer() -> None:
    unplaced = [module_name(path) for path in common_modules()
                if module_name(path) != "common" and layer_of(module_name(path)) is None]
    assert not unplaced, f"add these to LAYERS in {Path(__file__).name}: {unplaced}"


@pytest.mark.parametrize("path", common_modules(), ids=module_name)
def test_a_module_of_common_imports_only_its_layer_and_those_below(path: Path) -> None:
    importer = module_name(path)
    own = layer_of(importer)
    upward = sorted(name for name in imported_modules(path)
                    if name.startswith("common.") and (layer := layer_of(name)) is not None and own is not None
                    and layer > own)
    outside = sorted(name for name in imported_modules(path) if name.split(".")[0] in OUTSIDE_COMMON)
    assert not upward, f"{importer} (layer {own}) imports upwards: {upward}"
    assert not outside, f"{importer} imports outside common/: {outside}"


@pytest.mark.parametrize("recipe", sorted(p.parent.name for p in (REPO / "recipes").glob("*/train.py")))
def test_a_recipe_imports_no_other_recipe(recipe: str) -> None:
    others = {name for path in (REPO / "recipes" / recipe).rglob("*.py") for name in imported_modules(path)
              if name.startswith("recipes.") and name.split(".")[1] != recipe}
    assert not others, f"recipes/{recipe} imports {sorted(others)}"


def test_the_check_sees_an_upward_import_inside_a_function(tmp_path: Path) -> None:
    source = tmp_path / "module.py"
    source.write_text("def late():\n    from common.run.training_run import TrainingRun\n")
    assert "common.run.training_run" in imported_modules(source)
    assert layer_of("common.run.training_run") > layer_of("common.records.summary")
    assert layer_of("common.run_lock") == 5 and layer_of("common.run") == 7
