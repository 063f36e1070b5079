"""The draft-length policy: verify long drafts where they are cheap and likely accepted, none
where they cost more than they bring, learning both from observations."""

from __future__ import annotations

import pytest
import torch

from draftwise.controller import BatchController
from draftwise.draft_length import DraftLengthPolicy, _cost
from draftwise.drafters.base import Draft

# Seconds of one target forward by tokens scored, shaped like this machine's measurements.
FLOAT32 = {1: 0.23, 2: 0.39, 6: 0.43, 11: 0.48}  # any draft costs ~1.7x, long ones little more
BFLOAT16_AMX = {1: 0.18, 6: 0.19, 11: 0.19}  # drafts are nearly free
INT4 = {1: 0.09, 2: 0.13, 3: 0.15, 6: 0.21, 11: 0.31}  # every token costs


def policy_with(costs: dict[int, float], key, accepted_of_10: list[int]) -> DraftLengthPolicy:
    policy = DraftLengthPolicy()
    for num_tokens, seconds in costs.items():
        policy.observe_forward(num_tokens, seconds)
    for num_accepted in accepted_of_10:
        policy.observe_verdict(key, 10, num_accepted)
    return policy


def verified(policy: DraftLengthPolicy, key, num_available: int) -> int:
    """How many of num_available drafted tokens of this kind a request alone verifies: the
    engine's own path (draftwise.controller, a batch of one)."""
    draft = Draft(torch.zeros(num_available, dtype=torch.long), None, key)
    return BatchController(policy.forward_s).allocate([(policy, draft)], 1, 1).sizes[0]


def verified_nodes(policy: DraftLengthPolicy, key, scores: list[float]) -> int:
    """How many nodes of a scored tree (best first) a request alone verifies."""
    draft = Draft(torch.zeros(len(scores), dtype=torch.long), None, key, parents=torch.full((len(scores),), -1),
                  scores=torch.tensor(scores))
    return BatchController(policy.forward_s).allocate([(policy, draft)], 1, 1).sizes[0]


def test_measures_a_plain_step_before_drafting():
    assert verified(DraftLengthPolicy(), "n=2", 10) == 0


def test_long_drafts_when_forwards_are_flat_even_at_modest_acceptance():
    policy = policy_with(BFLOAT16_AMX, "n=1", [1, 0, 2, 1, 0, 3] * 5)
    assert verified(policy, "n=1", 10) == 10


def test_no_draft_when_a_draft_costs_more_than_it_brings():
    policy = policy_with(FLOAT32, "n=1", [0, 0, 1, 0, 0, 0] * 5)  # ~0.2 tokens accepted per draft
    assert verified(policy, "n=1", 10) == 0


def test_kinds_of_draft_are_judged_apart():
    policy = policy_with(FLOAT32, "n=1", [0, 0, 1, 0] * 5)
    for _ in range(20):
        policy.observe_verdict("n=4", 10, 10)  # long matches copy whole spans
    assert verified(policy, "n=1", 10) == 0
    assert verified(policy, "n=4", 10) == 10


def test_short_drafts_when_each_token_costs():
    policy = policy_with(INT4, "model", [2, 1, 3, 2, 1, 2] * 5)  # usually 1-3 accepted
    chosen = verified(policy, "model", 10)
    assert 1 <= chosen <= 5


def test_acceptance_follows_recent_behaviour():
    policy = policy_with(FLOAT32, "n=2", [10] * 20)
    assert verified(policy, "n=2", 10) == 10
    for _ in range(60):  # the text moved on: the same kind of match now fails
        policy.observe_verdict("n=2", 10, 0)
    assert verified(policy, "n=2", 10) == 0


def test_unmeasured_sizes_are_interpolated_between_measured_ones():
    policy = policy_with({1: 1.0, 3: 2.0, 11: 4.0}, "k", [])
    assert _cost(policy.forward_s, 2) == pytest.approx(1.5)
    assert _cost(policy.forward_s, 7) == pytest.approx(3.0)
    assert _cost(policy.forward_s, 16) == pytest.approx(4.0)  # beyond: optimistic, so it is tried


def test_a_draft_model_drafts_before_choosing_and_its_cost_counts():
    # Same acceptance (2-4 tokens in a row), same flat bf16 verify costs: a cheap draft model
    # drafts about as far as tokens get accepted, one costing a target forward per token
    # drafts nothing.
    cheap = policy_with(BFLOAT16_AMX, None, [3, 4, 2, 3] * 5)
    cheap.observe_draft(5, 0.05)
    assert cheap.choose_before_drafting(5) == 4
    dear = policy_with(BFLOAT16_AMX, None, [3, 4, 2, 3] * 5)
    dear.observe_draft(5, 5 * 0.18)
    assert dear.choose_before_drafting(5) == 0


def test_a_draft_model_that_stopped_drafting_is_probed_again():
    from draftwise.draft_length import PROBE_INTERVAL

    policy = policy_with(FLOAT32, None, [0] * 20)  # nothing accepted lately
    policy.observe_draft(5, 0.2)
    chosen = [policy.choose_before_drafting(5) for _ in range(2 * PROBE_INTERVAL)]
    # Plain steps, with a one-token probe every PROBE_INTERVAL steps so acceptance can recover.
    assert chosen.count(1) == 2 and set(chosen) == {0, 1}
    assert chosen.index(1) == PROBE_INTERVAL - 1


def test_a_new_request_relearns_acceptance_but_keeps_forward_costs():
    policy = policy_with(BFLOAT16_AMX, None, [0] * 30)  # a request where drafts always failed
    policy.observe_draft(5, 0.1)
    assert policy.choose_before_drafting(5) == 0
    policy.begin_request()
    assert policy.forward_s == BFLOAT16_AMX  # the hardware did not change
    assert policy.choose_before_drafting(5) > 0  # the new text gets tried


def test_tree_size_follows_measured_costs_and_calibrated_node_scores():
    policy = DraftLengthPolicy()
    for tokens, seconds in [(1, 0.010), (5, 0.011), (17, 0.030)]:
        policy.observe_forward(tokens, seconds)
    scores = [0.9, 0.8, 0.7, 0.6] + [0.1] * 12
    # 4 nodes: 1 + 3.0 expected tokens for 11 ms beats both 1 node (10.25 ms) and all 16 (30 ms).
    assert verified_nodes(policy, "tree", scores) == 4
    # Trees of this kind keep failing: the calibrated scores no longer pay for any node.
    for _ in range(40):
        policy.observe_tree_verdict("tree", predicted=sum(scores), num_accepted=0)
    assert verified_nodes(policy, "tree", scores) == 0
    assert verified_nodes(policy, "other", scores) == 4  # calibration is per kind of tree
