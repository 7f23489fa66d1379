"""DataLoader workers leave stop signals to their rank (common/data/loaders.py).

torchrun forwards SIGTERM and SIGUSR1 to each rank's whole process group, and SLURM signals
every process of a step, so the workers get them too. A worker must outlive both (the rank stops
after its checkpoint and shuts its workers down), but still end when its rank terminates it.
"""

from __future__ import annotations

import subprocess

import torch
from torch.utils.data import Dataset

from common.data.loaders import make_loader
from common.data.sampler import ResumableDistributedSampler

SAMPLES = 32


class Numbers(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


def test_a_worker_outlives_stop_signals_from_others_and_ends_when_its_rank_terminates_it() -> None:
    sampler = ResumableDistributedSampler(SAMPLES, shuffle=False, drop_last=False)
    loader = make_loader(Numbers(), sampler, batch_size=1, num_workers=1, pin_memory=False)
    batches = iter(loader)
    seen = [int(next(batches))]  # the worker runs, and has prefetched the next batches
    (worker,) = batches._workers
    for name in ("USR1", "TERM"):  # sent by another process, as torchrun's killpg and SLURM do
        subprocess.run(["kill", f"-{name}", str(worker.pid)], check=True)
    seen += [int(batch) for batch in batches]
    assert seen == list(range(SAMPLES)) and worker.is_alive()

    worker.terminate()  # SIGTERM from the worker's parent: the loader shutting it down
    worker.join(timeout=30)
    assert worker.exitcode == 0
