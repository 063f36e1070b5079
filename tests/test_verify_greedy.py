"""Greedy verification on hand-built logits."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftwise.verify import argmax_rows, verify_greedy


def logits_preferring(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    """[len(tokens), vocab] logits whose argmax at row i is tokens[i]."""
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_all_draft_tokens_accepted_then_bonus_token():
    verdict = verify_greedy(torch.tensor([3, 1, 4]), logits_preferring([3, 1, 4, 7]))
    assert verdict[:2] == (3, 7)


def test_first_mismatch_stops_acceptance_and_target_token_is_used():
    verdict = verify_greedy(torch.tensor([3, 2, 4]), logits_preferring([3, 1, 4, 7]))
    assert verdict[:2] == (1, 1)  # token 4 at position 2 matches too, but comes after a rejection


def test_rejection_at_first_position():
    assert verify_greedy(torch.tensor([5]), logits_preferring([0, 6]))[:2] == (0, 0)


def test_empty_draft_is_plain_greedy_step():
    assert verify_greedy(torch.empty(0, dtype=torch.long), logits_preferring([6]))[:2] == (0, 6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from([-1.0, 0.0, 2.0, 2.0, 3.0, float("nan"), float("-inf")]), min_size=1,
                         max_size=40), min_size=1, max_size=6).filter(lambda rows: len({len(r) for r in rows}) == 1))
def test_argmax_rows_is_torch_argmax_with_ties_and_nans(rows):
    """Greedy picks go through argmax_rows (max's indices, faster): the same index as argmax,
    the first of equal maxima, a NaN counting as the largest."""
    logits = torch.tensor(rows)
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
