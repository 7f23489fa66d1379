"""The docs say what is there: README.md, docs/*.md, the recipes' READMEs, cluster/README.md.

Every relative link resolves to a file or folder of the repository, and every ``#anchor`` to a
heading of the page it names, by MkDocs' slug (Python-Markdown's ``toc``), which must also be
GitHub's so the link works in both places. Every ``make <target>`` named in code is a target of
the Makefile (a pattern target's stem a recipe, or a ``<placeholder>``). Every config key named in
code (``trainer.batch_size``, ``data.decode=gpu``) is a key of some recipe's schema. And
``mkdocs build --strict`` builds the site ``make docs`` builds, with every picture in it: each
```mermaid`` diagram as the ``<pre class="mermaid">`` Material draws, on its page, and each image
copied into the site; the run's life names the exit codes of the table, and the layers' picture
says what ``tests/test_layers.py`` and the recipes' imports say. The testing page lists every test
marked ``slow`` and no other, each with why it must take what it takes.
"""

from __future__ import annotations

import ast
import dataclasses
import html
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import typing
import unicodedata
from pathlib import Path

import pytest

from common.config import RunConfig
from tests.test_layers import LAYERS, imported_modules, layer_of

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "cluster" / "README.md", *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "recipes").glob("*/README.md"))]
RECIPES = sorted(p.parent.name for p in (REPO / "recipes").glob("*/train.py"))

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
MAKE = re.compile(r"(?<![\w$(./-])make[ \t]+((?:-\S+[ \t]+|[A-Z_]+=(?:\"[^\"]*\"|'[^']*'|\S*)[ \t]+)*)"
                  r"([A-Za-z<][\w<>%.-]*)")
MERMAID = re.compile(r"^```mermaid[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?")
BUILT_MERMAID = re.compile(r'<pre class="mermaid"><code>(.*?)</code></pre>', re.DOTALL)
BUILT_IMAGE = re.compile(r'<img\b[^>]*\bsrc="([^"]+)"')
# The pictures issue 44 asked for: page -> what its picture must show.
PICTURES = {"run-contract.md": "mermaid: the run's life", "layout.md": "mermaid: the layers of common/",
            "after-training.md": "images/compare.png"}
SCHEMA_GROUPS = ("trainer", "checkpoint", "logging", "profile", "data", "model", "optim", "ema", "mixup", "fsdp",
                 "stages")
KEY = re.compile(r"(?<![\w./${-])((?:" + "|".join(SCHEMA_GROUPS) + r")(?:\.[A-Za-z_]\w*)+)(?![\w/-])")
FILE_SUFFIXES = {"py", "md", "yaml", "yml", "json", "jsonl", "safetensors", "pt", "tar", "txt", "csv", "png", "sh",
                 "isc", "sbatch", "log", "gz", "npz", "pickle"}


# ---- reading a page ------------------------------------------------------------------------------

def without_code(text: str) -> str:
    """``text`` with fenced blocks and inline code blanked out (links there are examples, not links)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return INLINE_CODE.sub(lambda m: " " * len(m.group(0)), text)


def code_of(text: str) -> list[str]:
    """The fenced blocks and inline code spans of ``text``: where commands and keys are named."""
    blocks = [m.group(0) for m in FENCE.finditer(text)]
    rest = FENCE.sub("", text)
    return blocks + [m.group(2) for m in INLINE_CODE.finditer(rest)]


def heading_texts(text: str) -> list[str]:
    """Each heading's text as rendered: no backticks or emphasis marks."""
    return [re.sub(r"[`*]", "", m.group(2)).strip() for m in HEADING.finditer(FENCE.sub("", text))]


def mkdocs_slug(heading: str) -> str:
    """Python-Markdown's ``toc`` slugify, which MkDocs uses."""
    value = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(page: Path) -> dict[str, str]:
    """MkDocs' anchors of ``page``'s headings (a repeated one gets ``_1``, ``_2``...), each with its
    heading's text."""
    found: dict[str, str] = {}
    for heading in heading_texts(page.read_text()):
        slug, n = mkdocs_slug(heading), 0
        while (slug if n == 0 else f"{slug}_{n}") in found:
            n += 1
        found[slug if n == 0 else f"{slug}_{n}"] = heading
    return found


# ---- the checks, each returning what is wrong ---------------------------------------------------

def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """Relative links of ``page`` whose file, folder or heading is missing."""
    problems = []
    for target in LINK.findall(without_code(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(root)}: ({target})"
        if not resolved.is_relative_to(root):
            problems.append(f"{where} points outside the repository")
        elif not resolved.exists():
            problems.append(f"{where}: no such file or folder")
        elif anchor:
            if resolved.suffix != ".md" or not resolved.is_file():
                problems.append(f"{where}: an anchor into something that is not a page")
                continue
            headings = anchors(resolved)
            if anchor not in headings:
                problems.append(f"{where}: {resolved.relative_to(root)} has no heading #{anchor}")
            elif github_slug(headings[anchor]) != anchor:
                problems.append(f"{where}: GitHub names heading {headings[anchor]!r} "
                                f"#{github_slug(headings[anchor])}; reword it so both agree")
    return problems


def makefile_targets(makefile: Path = REPO / "Makefile") -> set[str]:
    targets = set()
    for line in makefile.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.%-]+(?:[ \t]+[A-Za-z0-9_.%-]+)*)[ \t]*:(?![:=])", line)
        if match:
            targets.update(t for t in match.group(1).split() if not t.startswith("."))
    return targets


def unknown_make_targets(page: Path, targets: set[str], recipes: list[str] = RECIPES, root: Path = REPO) -> list[str]:
    """``make X`` in ``page``'s code where X is no target: a literal target, or a pattern target
    (``train-%``) whose stem is a recipe, a ``<placeholder>`` or a name the page makes with
    ``make new-recipe NAME=...``."""
    text = page.read_text()
    stems = set(recipes) | set(re.findall(r"\bNAME=(\w+)", text))
    problems = []
    for code in code_of(text):
        for _, named in MAKE.findall(code):
            named = named.rstrip(".")
            if named in targets or re.fullmatch(r"<[^<>]+>", named):  # `make <target>`: any target
                continue
            ok = False
            for target in (t for t in targets if "%" in t):
                prefix, _, suffix = target.partition("%")
                if named.startswith(prefix) and named.endswith(suffix) and len(named) > len(prefix) + len(suffix):
                    stem = named[len(prefix):len(named) - len(suffix)]
                    ok = ok or stem in stems or re.fullmatch(r"<[^<>]+>", stem) is not None
            if not ok:
                problems.append(f"{page.relative_to(root)}: `make {named}` is not a Makefile target")
    return problems


def schema_keys() -> set[str]:
    """Every key (and node) of every recipe's config schema, dotted."""
    keys: set[str] = set()

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            keys.add(prefix + field.name)
            if dataclasses.is_dataclass(hints[field.name]):
                walk(hints[field.name], f"{prefix}{field.name}.")

    for recipe in RECIPES:
        module = importlib.import_module(f"recipes.{recipe}.config")
        schemas = [value for value in vars(module).values() if isinstance(value, type)
                   and issubclass(value, RunConfig) and value is not RunConfig and value.__module__ == module.__name__]
        assert schemas, f"recipes/{recipe}/config.py has no schema (a RunConfig subclass)"
        for schema in schemas:
            walk(schema, "")
    return keys


def unknown_keys(page: Path, keys: set[str], root: Path = REPO) -> list[str]:
    """Config keys named in ``page``'s code that no recipe's schema has (file names left out)."""
    problems = []
    for code in code_of(page.read_text()):
        for key in KEY.findall(code):
            if key.rsplit(".", 1)[1] not in FILE_SUFFIXES and key not in keys:
                problems.append(f"{page.relative_to(root)}: `{key}` is not a key of any recipe's config")
    return problems


# ---- the tests ----------------------------------------------------------------------------------

def test_the_pages_are_there():
    assert (REPO / "docs" / "index.md") in DOCS
    assert len(DOCS) >= 10, DOCS


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page: Path):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_make_target_named_is_a_makefile_target(page: Path):
    assert unknown_make_targets(page, makefile_targets()) == []


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_config_key_named_is_in_a_recipe_schema(page: Path):
    assert unknown_keys(page, schema_keys()) == []


def test_readme_starts_with_the_two_commands_and_stays_short():
    text = (REPO / "README.md").read_text()
    first_block = FENCE.search(text)
    assert first_block is not None and text[:first_block.start()].strip() == "# Training recipes"
    commands = [line.split("#")[0].strip() for line in first_block.group(0).splitlines()[1:-1]]
    assert commands == ["make train-fashion_mnist", "make test"]
    assert len(text.splitlines()) <= 250


def test_the_checks_catch_a_broken_link_anchor_target_and_key(tmp_path: Path):
    """Each check above can fail: a page with one mistake of each kind gets one complaint each."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## PBS / Torque\n\n## Real heading\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#real-heading) [ok](#page) [web](https://example.org/x) `[not a link](nowhere.md)`\n"
        "[gone](missing.md) [no heading](other.md#fake) [GitHub differs](other.md#pbs-torque)\n\n"
        "```bash\nmake test PYTEST_ARGS=\"-k x\"\nmake train-<recipe> NPROC=2\nmake train-fashion_mnist\n"
        "make tset\nmake train-fahion_mnist\nmake new-recipe NAME=mine && make train-mine\n```\n\n"
        "`trainer.batch_size=8`, `model.py`, `trainer.bach_size`\n")
    targets = {"test", "train-%", "new-recipe"}
    assert broken_links(page, root=tmp_path) == [
        "docs/page.md: (missing.md): no such file or folder",
        "docs/page.md: (other.md#fake): docs/other.md has no heading #fake",
        "docs/page.md: (other.md#pbs-torque): GitHub names heading 'PBS / Torque' #pbs--torque; "
        "reword it so both agree",
    ]
    assert unknown_make_targets(page, targets, recipes=["fashion_mnist"], root=tmp_path) == [
        "docs/page.md: `make tset` is not a Makefile target",
        "docs/page.md: `make train-fahion_mnist` is not a Makefile target",
    ]
    assert unknown_keys(page, {"trainer", "trainer.batch_size"}, root=tmp_path) == [
        "docs/page.md: `trainer.bach_size` is not a key of any recipe's config"]


def built_page(site: Path, page: str) -> Path:
    """Where MkDocs writes ``docs/<page>`` (``use_directory_urls``: ``x.md`` -> ``x/index.html``)."""
    stem = Path(page).with_suffix("")
    return site / "index.html" if stem.name == "index" else site / stem / "index.html"


def missing_pictures(docs: Path, site: Path) -> list[str]:
    """Each ```mermaid fence of a page of ``docs`` that is not, with its content, a ``<pre class="mermaid">``
    of the built page, and each image of a page that the built page does not show from a file in ``site``."""
    problems = []
    for page in sorted(docs.glob("*.md")):
        text, built = page.read_text(), built_page(site, page.name)
        page_html = built.read_text() if built.is_file() else ""
        drawn = [html.unescape(block).strip() for block in BUILT_MERMAID.findall(page_html)]
        for diagram in MERMAID.findall(text):
            if diagram.strip() not in drawn:
                problems.append(f"{page.name}: a mermaid diagram ({diagram.splitlines()[0]}) is not a "
                                f'<pre class="mermaid"> of {built.relative_to(site)}')
        shown = {(built.parent / html.unescape(src)).resolve() for src in BUILT_IMAGE.findall(page_html)}
        for image in IMAGE.findall(without_code(text)):
            copied = (site / (page.parent / image).resolve().relative_to(docs.resolve())).resolve()
            if not copied.is_file() or copied not in shown:
                problems.append(f"{page.name}: image {image} is not shown from a file of the site")
    return problems


def mermaid_of(page: str, first_line: str) -> str:
    """The ```mermaid diagram of ``docs/<page>`` that starts with ``first_line``."""
    found = [d for d in MERMAID.findall((REPO / "docs" / page).read_text()) if d.startswith(first_line)]
    assert len(found) == 1, f"docs/{page}: {len(found)} mermaid diagrams start with {first_line!r}"
    return found[0]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site `make docs` builds (``mkdocs build --strict``), built once into a temporary folder."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs-material is not installed (pip install -e '.[dev]' installs it; make test does)")
    folder = tmp_path_factory.mktemp("site")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                             str(REPO / "mkdocs.yml"), "--site-dir", str(folder)],
                            cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr + result.stdout
    return folder


def test_mkdocs_builds_the_site_strictly(site: Path):
    """What `make docs` runs: a broken link, a missing anchor or a page left out of the nav fails it."""
    assert (site / "index.html").is_file()
    assert (site / "run-contract" / "index.html").is_file()


def test_every_picture_is_in_the_built_site(site: Path):
    """Each picture of docs/ renders: the pages issue 44 asked pictures of have theirs, each mermaid
    diagram is one Material draws, each image is copied and shown."""
    for page, picture in PICTURES.items():
        text = (REPO / "docs" / page).read_text()
        if picture.startswith("mermaid"):
            assert MERMAID.search(text), f"docs/{page} has no ```mermaid diagram ({picture})"
        else:
            assert picture in IMAGE.findall(without_code(text)), f"docs/{page} does not show {picture}"
    assert missing_pictures(REPO / "docs", site) == []


def test_the_picture_check_catches_an_unconfigured_fence_and_a_wrong_image_path(tmp_path: Path):
    """A diagram built as plain code (no custom fence for mermaid) or changed, and an image whose
    file is not in the site or not where the page points: one complaint each."""
    docs, site = tmp_path / "docs", tmp_path / "site"
    (docs / "images").mkdir(parents=True)
    (site / "a").mkdir(parents=True)
    (site / "b").mkdir(parents=True)
    (site / "images").mkdir(parents=True)
    (site / "images" / "there.png").write_bytes(b"png")
    (docs / "a.md").write_text("# A\n\n```mermaid\nflowchart TD\n    x --> y\n```\n\n![ok](images/there.png)\n"
                               "![gone](images/gone.png)\n")
    (docs / "b.md").write_text("# B\n\n```mermaid\nflowchart TD\n    p --> q\n```\n\n![moved](images/there.png)\n")
    (site / "a" / "index.html").write_text(
        '<pre class="mermaid"><code>flowchart TD\n    x --&gt; y\n</code></pre>'
        '<img alt="ok" src="../images/there.png"><img alt="gone" src="../images/gone.png">')
    (site / "b" / "index.html").write_text(
        '<div class="language-mermaid highlight"><pre><code>flowchart TD\n    p --&gt; q</code></pre></div>'
        '<img alt="moved" src="../img/there.png">')
    assert missing_pictures(docs, site) == [
        "a.md: image images/gone.png is not shown from a file of the site",
        'b.md: a mermaid diagram (flowchart TD) is not a <pre class="mermaid"> of b/index.html',
        "b.md: image images/there.png is not shown from a file of the site",
    ]
    (site / "a" / "index.html").write_text('<pre class="mermaid"><code>flowchart TD\n    x --&gt; z</code></pre>'
                                           '<img src="../images/there.png">')
    (docs / "a.md").write_text("```mermaid\nflowchart TD\n    x --> y\n```\n")
    assert missing_pictures(docs, site)[0].startswith("a.md: a mermaid diagram (flowchart TD) is not")


def exit_code_table() -> set[str]:
    """The codes of the run contract's exit-code table (``1 (or a signal)`` as ``1``)."""
    text = (REPO / "docs" / "run-contract.md").read_text()
    table = text[text.index("## Exit codes"):].split("\n\n")[1]
    return {row.split("|")[1].split()[0] for row in table.splitlines()[2:]}


def test_the_runs_life_names_every_exit_code_of_the_table_and_no_other():
    diagram = mermaid_of("run-contract.md", "flowchart TD\n    launch")
    drawn = set(re.findall(r"\(\[\"exit (\d+)\b", diagram))
    assert drawn == exit_code_table() == {"0", "1", "2", "3", "4", "75"}
    for said in ("SIGTERM", "SIGUSR1", "trainer.nonfinite", "rollback", "checkpoint.every_seconds",
                 "checkpoint.every_steps", "damaged", "summary.json"):
        assert said in diagram, said


def test_the_layers_picture_is_the_layers_and_the_recipes_imports():
    """Layer k's box names the modules of LAYERS[k] (tests/test_layers.py), each layer points to the one
    below; a recipe file's solid arrow to a layer holds for every recipe, a dashed one for some."""
    diagram = mermaid_of("layout.md", "flowchart TD\n    subgraph recipe")
    boxes = dict(re.findall(r'^\s*L(\d)\["\d ([^"]*)"\]', diagram, re.MULTILINE))
    assert sorted(boxes) == [str(k) for k in range(len(LAYERS))]
    for k, modules in enumerate(LAYERS):
        for module in modules:
            assert re.search(rf"\b{module.split('.', 1)[1]}\b", boxes[str(k)]), f"layer {k}: {module}"
    chain = " --> ".join(f"L{k}" for k in reversed(range(len(LAYERS))))
    assert chain in diagram
    files = dict(re.findall(r'^\s*(\w+)\["(\w+\.py):', diagram, re.MULTILINE))
    assert sorted(files.values()) == ["config.py", "data.py", "model.py", "spec.py", "testing.py", "train.py"]
    recipes = [REPO / "recipes" / recipe for recipe in RECIPES]
    arrows = re.findall(r"^\s*(\w+) (-->|-\.->) L(\d)$", diagram, re.MULTILINE)
    assert len(arrows) >= 8, arrows
    for node, arrow, layer in arrows:
        imports = [{layer_of(name) for name in imported_modules(folder / files[node])
                    if name.startswith("common.")} for folder in recipes]
        holds = [int(layer) in found for found in imports]
        assert all(holds) if arrow == "-->" else any(holds), f"{files[node]} {arrow} layer {layer}: {holds}"
    assert not any(name.startswith("common") for folder in recipes
                   for name in imported_modules(folder / "testing.py")), "testing.py imports common/"


SLOW_TABLE = "### Every slow test and why"


def slow_tests(tests: Path) -> set[str]:
    """``tests/<file>::<function>`` of every test function marked ``@pytest.mark.slow`` in ``tests``."""
    return {f"tests/{path.name}::{node.name}" for path in sorted(tests.glob("test_*.py"))
            for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.FunctionDef) and "pytest.mark.slow" in map(ast.unparse, node.decorator_list)}


def listed_slow_tests(page: str) -> dict[str, str]:
    """Each test the first column of the testing page's table of slow tests names -> its reason (the
    last column; a row may name several tests)."""
    table = next(block for block in page[page.index(SLOW_TABLE):].split("\n\n") if block.startswith("|"))
    rows = [row.split("|") for row in table.splitlines()[2:]]
    return {test: row[-2].strip() for row in rows for test in re.findall(r"`(tests/test_\w+\.py::\w+)`", row[1])}


def test_the_testing_page_lists_every_slow_test_and_why(tmp_path: Path):
    listed = listed_slow_tests((REPO / "docs" / "testing.md").read_text())
    marked = slow_tests(REPO / "tests")
    assert not marked - set(listed), f"marked slow, not in docs/testing.md's table: {sorted(marked - set(listed))}"
    assert not set(listed) - marked, f"in docs/testing.md's table, not marked slow: {sorted(set(listed) - marked)}"
    assert all(len(why) > 20 for why in listed.values()), "every slow test says why it must be slow"

    (tmp_path / "test_a.py").write_text("import pytest\n\n\n@pytest.mark.slow\ndef test_long():\n    pass\n\n\n"
                                        "@pytest.mark.parametrize('x', [1])\ndef test_short(x):\n    pass\n")
    assert slow_tests(tmp_path) == {"tests/test_a.py::test_long"}
