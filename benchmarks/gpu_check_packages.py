"""The Python packages ``make gpu-check`` needs, checked before anything imports them.

A GPU machine may run its own Python with PyTorch, torchvision, timm and transformers and none of
this project's other requirements, and reach no package index: the wheels of the rest go into
``.whl/`` (docs/benchmarks.md, "On a GPU machine without ``make setup``"). What is missing is then
one line, not a traceback from the first recipe that imports it. Standard library only: it runs
before torch is imported.
"""

from __future__ import annotations

import importlib.util
import sys

# Each module gpu-check's runs import, and the distribution (the wheel) it comes from.
NEEDED = {
    "torch": "torch", "torchvision": "torchvision", "timm": "timm", "transformers": "transformers",
    "safetensors": "safetensors", "numpy": "numpy", "PIL": "pillow", "cv2": "opencv-python-headless",
    "pandas": "pandas", "tqdm": "tqdm", "yaml": "pyyaml", "hydra": "hydra-core", "omegaconf": "omegaconf",
    "antlr4": "antlr4-python3-runtime", "albumentations": "albumentations", "scipy": "scipy", "pydantic": "pydantic",
    "pydantic_core": "pydantic-core", "annotated_types": "annotated-types", "typing_inspection": "typing-inspection",
    "albucore": "albucore", "stringzilla": "stringzilla", "simsimd": "simsimd",
}


def missing_packages(needed: dict[str, str] = NEEDED) -> list[str]:
    """The distributions whose module this Python cannot find (found, not imported: the check
    costs nothing in each recipe process gpu-check starts)."""
    missing = []
    for module, distribution in needed.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken or blocked package
            found = False
        if not found:
            missing.append(distribution)
    return missing


def exit_if_missing(needed: dict[str, str] = NEEDED) -> None:
    missing = missing_packages(needed)
    if missing:
        print(f"error: gpu-check needs Python packages that {sys.executable} does not have: {', '.join(missing)} "
              f"(run `make setup`, or on a GPU machine install the wheels in .whl/: see docs/benchmarks.md)",
              file=sys.stderr, flush=True)
        sys.exit(2)
