"""Greedy verification on hand-built logits."""

import torch

from draftwise.verify import verify_greedy


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
