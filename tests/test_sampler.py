"""The resumable sampler: coverage, reshuffling, mid-epoch resume, resume on another world size."""

from __future__ import annotations

import itertools

import pytest

from common.data.sampler import ResumableDistributedSampler


def epoch_indices(num_samples: int, world_size: int, epoch: int = 0, drop_last: bool = False,
                  seed: int = 0) -> list[list[int]]:
    ranks = [ResumableDistributedSampler(num_samples, rank, world_size, seed=seed, drop_last=drop_last)
             for rank in range(world_size)]
    for sampler in ranks:
        sampler.set_epoch(epoch)
    return [list(sampler) for sampler in ranks]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("num_samples", [30, 31, 32])
def test_every_sample_exactly_once_without_drop_last(world_size: int, num_samples: int) -> None:
    per_rank = epoch_indices(num_samples, world_size, drop_last=False)
    seen = list(itertools.chain.from_iterable(per_rank))
    assert sorted(seen) == list(range(num_samples))
    assert max(map(len, per_rank)) - min(map(len, per_rank)) <= 1


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_drop_last_gives_equal_ranks_and_drops_fewer_than_world_size(world_size: int) -> None:
    num_samples = 31
    per_rank = epoch_indices(num_samples, world_size, drop_last=True)
    seen = list(itertools.chain.from_iterable(per_rank))
    assert len(set(seen)) == len(seen), "a sample was repeated"
    assert len({len(indices) for indices in per_rank}) == 1
    assert num_samples - len(seen) == num_samples % world_size


def test_order_changes_between_epochs_and_repeats_for_the_same_seed() -> None:
    first = epoch_indices(100, 2, epoch=0)
    second = epoch_indices(100, 2, epoch=1)
    assert first != second
    assert first == epoch_indices(100, 2, epoch=0)
    assert first != epoch_indices(100, 2, epoch=0, seed=1)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_mid_epoch_resume_continues_exactly(world_size: int) -> None:
    num_samples, batch, batches_done = 50, 4, 3
    ranks = [ResumableDistributedSampler(num_samples, r, world_size, seed=7, drop_last=False)
             for r in range(world_size)]
    for sampler in ranks:
        sampler.set_epoch(2)
    uninterrupted = [list(sampler) for sampler in ranks]
    for sampler in ranks:
        sampler.advance(batch * batches_done)
    state = ranks[0].state_dict()
    assert state["consumed"] == batch * batches_done * world_size
    assert state["world_size"] == world_size and state["seed"] == 7 and state["epoch"] == 2

    resumed = []
    for rank in range(world_size):
        sampler = ResumableDistributedSampler(num_samples, rank, world_size, seed=7, drop_last=False)
        sampler.load_state_dict(state)
        resumed.append(list(sampler))
    for rank in range(world_size):
        assert resumed[rank] == uninterrupted[rank][batch * batches_done:]


@pytest.mark.parametrize(("old_world", "new_world"), [(2, 3), (3, 2), (2, 1), (1, 3)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_on_a_different_world_size_skips_and_repeats_nothing(old_world: int, new_world: int,
                                                                     drop_last: bool) -> None:
    num_samples, per_rank_done = 47, 5
    old = [ResumableDistributedSampler(num_samples, r, old_world, seed=3, drop_last=drop_last)
           for r in range(old_world)]
    for sampler in old:
        sampler.set_epoch(1)
    done = list(itertools.chain.from_iterable(list(sampler)[:per_rank_done] for sampler in old))
    for sampler in old:
        sampler.advance(per_rank_done)
    state = old[0].state_dict()

    rest = []
    for rank in range(new_world):
        sampler = ResumableDistributedSampler(num_samples, rank, new_world, seed=3, drop_last=drop_last)
        sampler.load_state_dict(state)
        rest.append(list(sampler))
    seen = done + list(itertools.chain.from_iterable(rest))
    assert len(seen) == len(set(seen)), "a sample was repeated"
    remaining = num_samples - len(done)
    if drop_last:
        assert len(seen) == num_samples - remaining % new_world
        assert len({len(r) for r in rest}) == 1
    else:
        assert sorted(seen) == list(range(num_samples))


def test_epoch_with_keys_for_per_sample_seeding() -> None:
    sampler = ResumableDistributedSampler(10, 0, 1, seed=0, yield_epoch=True)
    sampler.set_epoch(4)
    keys = list(sampler)
    assert all(epoch == 4 for epoch, _ in keys)
    assert sorted(index for _, index in keys) == list(range(10))


def test_a_checkpoint_from_another_dataset_is_refused() -> None:
    state = ResumableDistributedSampler(10, 0, 1).state_dict()
    with pytest.raises(ValueError, match="10 samples"):
        ResumableDistributedSampler(12, 0, 1).load_state_dict(state)


def test_index_batches_cover_the_rest_of_the_epoch_and_are_empty_once_it_is_done() -> None:
    sampler = ResumableDistributedSampler(50, rank=1, world_size=2, seed=3)
    sampler.set_epoch(0, consumed=10)
    batches = sampler.index_batches(8)
    assert [len(batch) for batch in batches] == [8, 8, 4]
    assert [int(i) for batch in batches for i in batch] == list(sampler)
    sampler.advance(20)  # a checkpoint taken on the epoch's last step resumes here
    assert len(sampler) == 0 and sampler.index_batches(8) == ()
