"""Rollback property: after any sequence of accept/reject steps, the cache equals the cache of
replaying the committed tokens without speculation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftwise.errors import DraftwiseError
from draftwise.kv_cache import KVCache

# Replaying in one forward and in many rounds differently in the last bits of float32.
ATOL = 1e-4


@pytest.fixture(scope="module")
def small_target(smollm2):
    """The real SmolLM2 cut to its first 3 layers: real weights, fast enough for many examples."""
    return smollm2.model.truncated(3)


steps_strategy = st.lists(
    st.tuples(st.integers(1, 6), st.integers(0, 6), st.integers(0, 49151)),  # (proposed, accepted, extra token)
    min_size=1, max_size=6,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=steps_strategy, seed=st.integers(0, 2**16))
def test_cache_after_speculative_steps_equals_replay(small_target, steps, seed):
    generator = torch.Generator().manual_seed(seed)
    committed = torch.randint(0, 49152, (5,), generator=generator)  # a prompt
    cache = small_target.new_cache(64)
    small_target.forward(committed[:-1], torch.arange(4), cache)
    for num_proposed, num_accepted, extra_token in steps:
        num_accepted = min(num_accepted, num_proposed)
        draft = torch.randint(0, 49152, (num_proposed,), generator=generator)
        num_committed = committed.shape[0]
        inputs = torch.cat((committed[-1:], draft))
        small_target.forward(inputs, torch.arange(num_committed - 1, num_committed + num_proposed), cache)
        cache.truncate(num_committed + num_accepted)  # what the engine does after verification
        committed = torch.cat((committed, draft[:num_accepted], torch.tensor([extra_token])))
        assert cache.length == committed.shape[0] - 1

    replay = small_target.new_cache(64)
    small_target.forward(committed[:-1], torch.arange(committed.shape[0] - 1), replay)
    length = cache.length
    assert replay.length == length
    assert torch.allclose(cache.keys[:, :, :, :length], replay.keys[:, :, :, :length], atol=ATOL)
    assert torch.allclose(cache.values[:, :, :, :length], replay.values[:, :, :, :length], atol=ATOL)


def test_rollback_beyond_cached_length_raises():
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=4, max_length=8)
    cache.reserve(3)
    with pytest.raises(DraftwiseError, match="cannot roll back 4"):
        cache.rollback(4)


def test_overflowing_the_cache_raises_instead_of_writing_out_of_bounds():
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=4, max_length=8)
    cache.reserve(6)
    with pytest.raises(DraftwiseError, match="overflow"):
        cache.reserve(3)
