"""Tree verification on hand-built trees: greedy takes the longest matching path, and multi-draft
rejection sampling over siblings is lossless (emitted tokens follow the target distribution).

Design of the lossless test. The target's next-token distribution is a fixed function of the
context (a seeded table keyed by the tokens after the root), so a tree's nodes each get the
distribution of their own context. Per trial the verifier walks the tree; the first two emitted
tokens (the second drawn from the target itself when the step emitted only one) must follow the
target's joint distribution of two tokens: a Pearson chi-square test over all VOCAB**2 pairs.
Power: as in test_verify_lossless.py, the sample size detects a deviation of Cohen's w =
EFFECT_SIZE with probability POWER at level ALPHA. A negative control (siblings tried against
the ORIGINAL target distribution instead of the residual the rejected ones left) must be
rejected by the same test.
"""

from __future__ import annotations

import functools
import itertools
import zlib

import numpy as np
import pytest
import torch

from draftwise.config import SamplingParams
from draftwise.sampling import logits_to_probs, make_generator, sample
from draftwise.tree import ancestor_mask, children_lists, depths
from draftwise.verify import Verdict, verify_tree_greedy, verify_tree_rejection
from tests.test_verify_lossless import ALPHA, EFFECT_SIZE, chi_square_p_value, cohens_w, required_samples

VOCAB = 6


@functools.lru_cache(maxsize=None)
def target_row(context: tuple[int, ...], params: SamplingParams) -> torch.Tensor:
    """The target's distribution after the root and `context`: fixed per context, [VOCAB]."""
    generator = torch.Generator().manual_seed(zlib.crc32(repr(context).encode()))
    return logits_to_probs(torch.randn(VOCAB, generator=generator) * 1.5, params)


def node_contexts(tokens: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    contexts: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents):
        contexts.append((contexts[parent] if parent >= 0 else ()) + (token,))
    return contexts


def target_rows(tokens: list[int], parents: list[int], params: SamplingParams) -> torch.Tensor:
    """[1 + n, VOCAB]: the root's distribution, then each node's."""
    return torch.stack([target_row(context, params) for context in [()] + node_contexts(tokens, parents)])


# Trees as parents; a tree's tokens are fixed (point masses) or drawn per trial from draft rows.
DEEP_TREE = [-1, -1, -1, 0, 0, 1, 3]  # root -> {0, 1, 2}; 0 -> {3, 4}; 1 -> {5}; 3 -> {6}
DEEP_TOKENS = [4, 3, 2, 5, 3, 1, 0]  # likely tokens, so that rejections and deep paths both happen


def buggy_tree_rejection(draft_tokens, parents, draft_probs, target_probs, generator) -> Verdict:
    """NEGATIVE CONTROL: tries every sibling against the target's own distribution instead of
    the residual left by the rejected ones (then samples the residual of all of them)."""
    tokens = draft_tokens.tolist()
    children = children_lists(parents)
    path, row = [], 0
    while True:
        original = target_probs[row]
        residual = original.clone()
        for child in children[row]:
            if float(torch.rand(1, generator=generator)) < float(original[tokens[child]]):
                path.append(child)
                row = child + 1
                break
            residual[tokens[child]] = 0.0
        else:
            return Verdict(len(path), int(sample(residual / residual.sum(), generator)), tuple(path))


def run_trials(verifier, params: SamplingParams, parents: list[int], fixed_tokens: list[int] | None,
               num_siblings_iid: int, num_trials: int, seed: int) -> np.ndarray:
    """Counts of the first two emitted tokens, [VOCAB, VOCAB]."""
    generator = make_generator(seed)
    counts = np.zeros((VOCAB, VOCAB), dtype=np.int64)
    root_draft = logits_to_probs(torch.randn(VOCAB, generator=torch.Generator().manual_seed(99)) * 1.5, params)
    for _ in range(num_trials):
        if fixed_tokens is not None:
            tokens, draft_probs = fixed_tokens, None
        else:  # num_siblings_iid independent draws from one draft row: the case SpecInfer proves
            tokens = sample(root_draft.expand(num_siblings_iid, VOCAB), generator).tolist()
            draft_probs = root_draft.expand(num_siblings_iid, VOCAB)
        parents_tensor = torch.tensor(parents)
        verdict = verifier(torch.tensor(tokens), parents_tensor, draft_probs, target_rows(tokens, parents, params),
                           generator)
        emitted = [tokens[node] for node in verdict.accepted_nodes()] + [verdict.next_token]
        if len(emitted) == 1:  # the next step's first token comes from the target itself
            emitted.append(int(sample(target_row(tuple(emitted), params), generator)))
        counts[emitted[0], emitted[1]] += 1
    return counts


def joint_target(params: SamplingParams) -> np.ndarray:
    first = target_row((), params).numpy()
    return np.stack([first[x] * target_row((x,), params).numpy() for x in range(VOCAB)])  # [VOCAB, VOCAB]


CASES = {
    "three-point-mass-siblings": (SamplingParams(temperature=1.0), [-1, -1, -1], [1, 3, 0], 0),
    "deep-tree": (SamplingParams(temperature=1.0), DEEP_TREE, DEEP_TOKENS, 0),
    "deep-tree-top-k-3": (SamplingParams(temperature=0.8, top_k=3), DEEP_TREE, DEEP_TOKENS, 0),
    "deep-tree-top-p-0.8": (SamplingParams(temperature=1.0, top_p=0.8), DEEP_TREE, DEEP_TOKENS, 0),
    "three-iid-sampled-siblings": (SamplingParams(temperature=1.0), [-1, -1, -1], None, 3),
    "iid-siblings-top-k-4": (SamplingParams(temperature=1.0, top_k=4), [-1, -1, -1], None, 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tree_rejection_sampling_emits_the_target_distribution(case):
    params, parents, tokens, num_iid = CASES[case]
    num_trials = required_samples(VOCAB * VOCAB)
    counts = run_trials(verify_tree_rejection, params, parents, tokens, num_iid, num_trials, seed=zlib.crc32(case.encode()))
    assert chi_square_p_value(counts.ravel(), joint_target(params).ravel()) > ALPHA


def test_negative_control_siblings_against_the_original_distribution_is_rejected():
    params, parents, tokens, _ = CASES["deep-tree"]
    expected = joint_target(params).ravel()
    counts = run_trials(buggy_tree_rejection, params, parents, tokens, 0, required_samples(VOCAB * VOCAB), seed=3)
    observed = counts.ravel() / counts.sum()
    assert cohens_w(observed, expected) >= 2 * EFFECT_SIZE  # the bug is big enough for the stated power
    assert chi_square_p_value(counts.ravel(), expected) < ALPHA


def test_greedy_tree_takes_the_longest_path_of_argmax_tokens():
    parents = torch.tensor(DEEP_TREE)
    tokens = torch.tensor(DEEP_TOKENS)
    logits = torch.zeros(1 + len(DEEP_TREE), VOCAB)
    # Target argmax: root -> 4 (node 0), node 0 -> 3 (node 4), node 4 -> 2 (no child: next token).
    for row, best in [(0, 4), (1, 3), (5, 2)]:
        logits[row, best] = 5.0
    verdict = verify_tree_greedy(tokens, parents, logits)
    assert verdict.accepted_nodes() == [0, 4] and verdict.next_token == 2
    # Root's argmax matches no child: nothing accepted, the argmax is the next token.
    logits[0] = 0.0
    logits[0, 5] = 5.0
    verdict = verify_tree_greedy(tokens, parents, logits)
    assert verdict.num_accepted == 0 and verdict.next_token == 5


def test_tree_helpers_give_depths_and_ancestor_masks():
    parents = torch.tensor(DEEP_TREE)
    assert depths(parents).tolist() == [1, 1, 1, 2, 2, 2, 3]
    mask = ancestor_mask(parents)
    # Node 6 (row 7) sees the root, node 0, node 3 and itself only.
    assert torch.nonzero(mask[7]).ravel().tolist() == [0, 1, 4, 7]
    for row, column in itertools.product(range(8), repeat=2):
        assert not mask[row, column] or column <= row  # parents precede children


def test_a_parents_vector_that_is_not_a_tree_is_refused():
    from draftwise.drafters.base import Draft

    with pytest.raises(ValueError, match="parents"):
        Draft(torch.tensor([1, 2]), None, parents=torch.tensor([-1, 1]))  # node 1 its own parent
