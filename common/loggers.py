"""Rank-0 output: console lines, a progress bar, and TensorBoard or W&B (or nothing).

W&B is imported only when chosen and runs offline unless ``wandb_mode`` says otherwise, so a
job on a node without internet never blocks on it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from tqdm import tqdm


class RunLogger:
    def __init__(
        self,
        backend: str,
        log_dir: str | Path,
        is_main: bool,
        run_name: str,
        config: Mapping[str, Any] | None = None,
        resume_step: int = 0,
        wandb_project: str = "training-recipes",
        wandb_mode: str = "offline",
        progress_bar: bool = True,
    ) -> None:
        self.is_main = is_main
        self.progress_bar = progress_bar and is_main
        self.backend = backend if is_main else "none"
        self._writer: Any = None
        self._wandb: Any = None
        self.log_dir = Path(log_dir)
        if self.backend == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.log_dir.mkdir(parents=True, exist_ok=True)
            # purge_step drops events a killed segment logged after its last checkpoint.
            self._writer = SummaryWriter(str(self.log_dir), purge_step=resume_step or None)
        elif self.backend == "wandb":
            import wandb

            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(
                project=wandb_project,
                name=run_name,
                id=run_name.replace("/", "-"),
                resume="allow",
                dir=str(self.log_dir),
                mode=wandb_mode,
                config=dict(config or {}),
            )
        elif self.backend != "none":
            raise ValueError(f"logging backend must be tensorboard, wandb or none, not {backend!r}")

    @classmethod
    def from_config(cls, cfg: Any, is_main: bool, resume_step: int = 0) -> RunLogger:
        """From a recipe's whole config (its ``logging`` node, name and recipe)."""
        return cls(
            cfg.logging.backend,
            cfg.logging.dir,
            is_main,
            run_name=f"{cfg.recipe}/{cfg.name}",
            config=OmegaConf.to_container(cfg, resolve=True),
            resume_step=resume_step,
            wandb_project=cfg.logging.wandb_project,
            wandb_mode=cfg.logging.wandb_mode,
            progress_bar=cfg.logging.progress_bar,
        )

    def console(self, message: str) -> None:
        if self.is_main:
            tqdm.write(message, file=sys.stdout)
            sys.stdout.flush()

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._writer is not None:
            for name, value in metrics.items():
                self._writer.add_scalar(name, value, step)
        elif self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)

    def progress(self, total: int, initial: int, description: str) -> tqdm:
        """A progress bar on rank 0 (a silent one elsewhere or when disabled)."""
        return tqdm(
            total=total,
            initial=initial,
            desc=description,
            disable=not self.progress_bar,
            dynamic_ncols=True,
            leave=False,
            file=sys.stderr,
        )

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()
