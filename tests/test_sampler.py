import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm.data.sampler import ResumableDistributedSampler


def _segment(num_samples, state, world, per_rank_batch, rounds, seed):
    """Ranks of one job start from `state`, take `rounds` global batches (or everything left if rounds is None)
    and return what each took in global order, plus the new state."""
    samplers = [ResumableDistributedSampler(num_samples, world, r, seed=seed) for r in range(world)]
    for s in samplers:
        s.load_state_dict(state)
    streams = [list(iter(s)) for s in samplers]
    take = max(map(len, streams)) if rounds is None else rounds * per_rank_batch
    taken_per_rank = [stream[:take] for stream in streams]
    # interleave back into global order: position j*world + r belongs to rank r
    global_taken = [taken_per_rank[r][j] for j in range(take) for r in range(world) if j < len(taken_per_rank[r])]
    samplers[0].advance(len(global_taken))
    return global_taken, samplers[0].state_dict()


@settings(max_examples=300, deadline=None)
@given(num_samples=st.integers(1, 300), seed=st.integers(0, 2**31),
       segments=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(0, 6)), max_size=6),
       final_world=st.integers(1, 4))
def test_every_sample_once_per_epoch_across_interruptions_and_world_sizes(num_samples, seed, segments, final_world):
    state = ResumableDistributedSampler(num_samples, seed=seed).state_dict()
    seen = []
    for world, per_rank_batch, rounds in segments:
        if num_samples - state["consumed"] < rounds * per_rank_batch * world:
            continue  # the trainer never starts a step it cannot fill
        taken, state = _segment(num_samples, state, world, per_rank_batch, rounds, seed)
        seen += taken
    taken, state = _segment(num_samples, state, final_world, 1, None, seed)
    seen += taken
    order = ResumableDistributedSampler(num_samples, seed=seed).global_order(0)
    assert sorted(seen) == list(range(num_samples))  # each sample exactly once
    assert seen == order.tolist()  # and in the one global order, whatever the world sizes
    assert state["consumed"] == num_samples


def test_rank_lengths_sum_to_the_remaining_samples():
    for world in range(1, 5):
        for consumed in (0, 3, 10):
            samplers = [ResumableDistributedSampler(23, world, r, seed=1) for r in range(world)]
            for s in samplers:
                s.advance(consumed)
            assert sum(len(s) for s in samplers) == 23 - consumed
            assert all(len(s) == len(list(iter(s))) for s in samplers)


def test_order_is_deterministic_per_seed_and_epoch():
    a, b = ResumableDistributedSampler(100, seed=7), ResumableDistributedSampler(100, seed=7)
    assert list(a) == list(b)
    b.set_epoch(1)
    assert list(a) != list(b)
    assert sorted(b) == list(range(100))
    assert list(ResumableDistributedSampler(100, seed=8)) != list(a)
    assert np.array_equal(ResumableDistributedSampler(5, shuffle=False).global_order(3), np.arange(5))


def test_mismatched_state_is_refused():
    with pytest.raises(ValueError, match="11 samples"):
        ResumableDistributedSampler(10, seed=1).load_state_dict(ResumableDistributedSampler(11, seed=1).state_dict())
