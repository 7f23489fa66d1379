"""A launcher's own pre-emption handler (submitit's requeue on SIGUSR2) runs only after the checkpoint.

submitit raises SystemExit from its signal handler wherever the program is; inside torch.save
that became a failed save and a failed sweep job. The recipes take the signal over, checkpoint
at the end of the step, then hand it to the launcher's handler.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from tests.conftest import latest_step, recipe_env, start_recipe

# Stands in for submitit: a USR2 handler installed before the recipe starts, which records the
# newest committed checkpoint when it runs and exits the way submitit's does after requeueing.
LAUNCHER_HANDLER = """\
import os
import signal
import sys
from pathlib import Path


def _requeue_and_exit(signum, frame):
    from common.checkpoint.layout import latest_checkpoint

    latest = latest_checkpoint(os.environ["TEST_CHECKPOINT_DIR"])
    Path(os.environ["TEST_MARKER"]).write_text(str(-1 if latest is None else latest.step))
    sys.exit(3)


signal.signal(signal.SIGUSR2, _requeue_and_exit)
"""


def test_a_launchers_usr2_handler_runs_after_the_stop_checkpoint(fashion_data: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(LAUNCHER_HANDLER)
    run_dir, marker = tmp_path / "run", tmp_path / "handled"
    env = recipe_env(PYTHONPATH=str(site), TEST_CHECKPOINT_DIR=str(run_dir / "checkpoints"),
                     TEST_MARKER=str(marker))
    # No periodic checkpoint: the only one can be the one written for the signal.
    overrides = [f"data.root={fashion_data}", f"run_dir={run_dir}", "model.channels=[4,8]", "model.hidden=16",
                 "trainer.batch_size=8", "trainer.epochs=50", "trainer.log_every_steps=1",
                 "checkpoint.every_steps=0", "checkpoint.every_seconds=0", "logging.backend=none",
                 "logging.progress_bar=false"]
    process = start_recipe("fashion_mnist", overrides, env=env)
    metrics = run_dir / "tensorboard" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0]
        time.sleep(0.05)
    process.send_signal(signal.SIGUSR2)
    output, _ = process.communicate(timeout=120)

    assert process.returncode == 3, output  # the launcher's handler ended the process
    assert "Traceback" not in output, output
    handled_at = int(marker.read_text())
    assert handled_at > 0, "the launcher's handler ran before any checkpoint was committed"
    assert handled_at == latest_step(run_dir / "checkpoints")
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert handled_at == max(logged), "the checkpoint is not at the step the run stopped"
