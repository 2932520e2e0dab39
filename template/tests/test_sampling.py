"""The harness decides which samples each rank reads, from one global position."""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from conftest import project_module

# Every test here touches an API that differs between torch releases (make test-torch).
pytestmark = pytest.mark.torch_api


@pytest.fixture
def sampling():
    return project_module("loop.sampling")


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_global_batch_is_the_same_whatever_the_world_size(sampling, world_size):
    sampler = sampling.GlobalBatchSampler(num_samples=37, global_batch_size=8, seed=3)
    split = sampling.split_global_batch(8, 1, world_size)
    for consumed in (0, 8, 32, 40, 296):  # includes epoch boundaries
        shares = [torch.cat(sampler.rank_micro_batches(consumed, r, split))
                  for r in range(world_size)]
        assert torch.equal(torch.cat(shares), sampler.global_batch(consumed))


def test_every_sample_is_seen_once_per_epoch(sampling):
    sampler = sampling.GlobalBatchSampler(num_samples=24, global_batch_size=8, seed=0)
    seen = torch.cat([sampler.global_batch(c) for c in (0, 8, 16)])
    assert sorted(seen.tolist()) == list(range(24))
    assert not torch.equal(sampler.global_batch(24), sampler.global_batch(0))  # new epoch order


def test_grad_accumulation_keeps_the_global_batch(sampling):
    assert sampling.split_global_batch(16, 2, 1).grad_accum_steps == 8
    assert sampling.split_global_batch(16, 2, 2).grad_accum_steps == 4
    assert sampling.split_global_batch(16, 2, 8).grad_accum_steps == 1


def test_world_size_that_does_not_divide_is_refused_with_options(sampling):
    with pytest.raises(sampling.BatchSizeError) as info:
        sampling.split_global_batch(16, 2, 3)
    message = str(info.value)
    assert "3 ranks" in message and "[1, 2, 4, 8]" in message


@pytest.mark.parametrize("workers", [0, 2])
def test_data_loader_reads_this_ranks_share_from_any_position(sampling, workers):
    """The loader, with or without worker processes, yields exactly the sampler's indices."""
    sampler = sampling.GlobalBatchSampler(num_samples=50, global_batch_size=8, seed=5)
    split = sampling.split_global_batch(8, 2, 2)
    dataset = list(range(50))  # sample i is i: the batches show the indices read
    for start in (0, 48):
        loader = DataLoader(dataset, num_workers=workers,
                            batch_sampler=sampling.RankMicroBatches(sampler, split, 1, start))
        got = iter(loader)
        for step in range(3):
            expected = sampler.rank_micro_batches(start + 8 * step, 1, split)
            for indices in expected:
                assert next(got).tolist() == indices.tolist()


def test_generated_corpus_is_deterministic():
    text = project_module("datasets")
    assert text.generate_corpus(5000) == text.generate_corpus(5000)
    assert len(text.generate_corpus(5000)) == 5000


@pytest.mark.parametrize("n", [1, 2, 3, 37, 1000, 4097])
def test_permutation_is_a_bijection_that_depends_on_the_seed(sampling, n):
    orders = [sampling.Permutation(n, seed)(np.arange(n)).tolist() for seed in (0, 1)]
    assert all(sorted(order) == list(range(n)) for order in orders)
    assert n < 37 or orders[0] != orders[1]


def test_sampler_memory_does_not_grow_with_the_dataset(sampling):
    """Ten billion samples: the permutation is computed at the positions asked, not stored."""
    sampler = sampling.GlobalBatchSampler(num_samples=10**10, global_batch_size=4096, seed=1)
    batch = sampler.global_batch(3 * 10**10 - 100)  # across the end of epoch 2
    assert len(set(batch.tolist())) == 4096 and 0 <= batch.min() and batch.max() < 10**10
