"""What the run contract adds to a training step, counted in operators on the CPU.

A steady step of fashion_mnist's real loop runs the operators of a bare PyTorch step (the same
model, optimizer, schedule and batch) and those the loop and the shared layer add: the metric sums,
the loss scaling of accumulation, the divergence watch, the telemetry (``benchmarks/overhead.py``'s
``step_operators``). On a GPU each added operator is a kernel launch or a host call inside the step,
which is where ``make bench``'s overhead comes from. A timing test would be flaky; a count is exact,
so it is held to a budget: an operator added to every step is a decision, not an accident.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, recipe_env

# What a steady step adds today (fashion_mnist, fp32, CPU), 13 operators: the loss scaled by its
# share of the step's samples (mul, and mul in its backward); the loss and the top-1 hits added to
# the metric sums (detach, mul; argmax, eq, sum; detach and add for each sum); the divergence watch
# reading the running loss (detach; on the CPU _local_scalar_dense, on a GPU isfinite and where).
ADDED_BUDGET = 13

COUNT = """
import json, sys, tempfile
from pathlib import Path
from benchmarks.overhead import step_operators
with tempfile.TemporaryDirectory() as workdir:
    recipe, bare = step_operators(Path(workdir))
print(json.dumps({"recipe": recipe, "bare": bare}))
"""


def test_a_steady_step_adds_at_most_the_budgeted_operators_to_the_bare_step(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-c", COUNT], cwd=REPO, env=recipe_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = json.loads(result.stdout.splitlines()[-1])
    recipe, bare = counts["recipe"], counts["bare"]
    added = {name: recipe[name] - bare.get(name, 0) for name in recipe if recipe[name] > bare.get(name, 0)}
    missing = {name: bare[name] - recipe.get(name, 0) for name in bare if bare[name] > recipe.get(name, 0)}
    assert not missing, f"the recipe's step lacks operators of the bare step: {missing}"
    assert sum(added.values()) <= ADDED_BUDGET, f"{sum(added.values())} operators added to each step: {added}"
