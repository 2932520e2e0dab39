import pytest
import torch


@pytest.fixture
def data(package):
    return __import__(f"{package.__name__}.data", fromlist=["plan_batches"])


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_global_batch_is_the_same_whatever_the_world_size(data, world_size):
    sampler = data.GlobalBatchSampler(num_samples=37, global_batch_size=8, seed=3)
    plan = data.plan_batches(8, 1, world_size)
    for consumed in (0, 8, 32, 40, 296):  # includes epoch boundaries
        shares = [torch.cat(sampler.rank_micro_batches(consumed, r, plan))
                  for r in range(world_size)]
        assert torch.equal(torch.cat(shares), sampler.global_batch(consumed))


def test_every_sample_is_seen_once_per_epoch(data):
    sampler = data.GlobalBatchSampler(num_samples=24, global_batch_size=8, seed=0)
    seen = torch.cat([sampler.global_batch(c) for c in (0, 8, 16)])
    assert sorted(seen.tolist()) == list(range(24))
    assert not torch.equal(sampler.global_batch(24), sampler.global_batch(0))  # new epoch order


def test_grad_accumulation_keeps_the_global_batch(data):
    assert data.plan_batches(16, 2, 1).grad_accum_steps == 8
    assert data.plan_batches(16, 2, 2).grad_accum_steps == 4
    assert data.plan_batches(16, 2, 8).grad_accum_steps == 1


def test_world_size_that_does_not_divide_is_refused_with_options(data):
    with pytest.raises(data.BatchSizeError) as info:
        data.plan_batches(16, 2, 3)
    message = str(info.value)
    assert "3 ranks" in message and "[1, 2, 4, 8]" in message


def test_generated_corpus_is_deterministic(data):
    assert data.generate_corpus(5000) == data.generate_corpus(5000)
    assert len(data.generate_corpus(5000)) == 5000
