"""Token-level intersection drafting is lossless: emitted tokens follow the target's distribution
although the draft speaks another vocabulary.

Same design and power as tests/test_verify_lossless.py (chi-square goodness of fit at ALPHA,
sample size giving POWER against a deviation of Cohen's w = EFFECT_SIZE): a draft token is
sampled from the draft's distribution restricted to the shared tokens (Intersection.restrict),
mapped to its target id, and verified by rejection sampling with the draft distribution carried
to target ids (Intersection.to_target). Hand-built vocabularies of different sizes and partial
overlap (with two draft tokens spelling one target token, and a control token) come first;
then the real pair (Qwen2.5-Coder-0.5B target, SmolLM2-135M draft) at one position of a real
prompt. A negative control (the restricted draft distribution used without renormalising)
must be rejected by the same test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draftwise.config import SamplingParams
from draftwise.drafters.cross_vocab import CrossVocabDrafter, Intersection
from draftwise.drafters.vocab import Vocabulary, build_vocabulary_map
from draftwise.engine import Engine
from draftwise.sampling import logits_to_probs, make_generator, sample
from draftwise.verify import verify_rejection
from tests.test_verify_lossless import ALPHA, EFFECT_SIZE, chi_square_p_value, cohens_w, required_samples

# Target: 7 tokens; draft: 9 tokens, 6 of them shared (draft 0 and 5 both spell "a"; <eos> is a
# control token in both), 3 draft-only ("x", "y", "z").
TARGET = Vocabulary((b"a", b"b", b"c", b"ab", b"d", b"<eos>", b"e"), frozenset({5}))
DRAFT = Vocabulary((b"a", b"x", b"b", b"ab", b"y", b"a", b"z", b"c", b"<eos>"), frozenset({8}))
# A second pair the other way round: a small draft (5 tokens, 3 shared) for a larger target (12).
BIG_TARGET = Vocabulary(tuple(bytes([ord("a") + i]) for i in range(12)), frozenset())
SMALL_DRAFT = Vocabulary((b"c", b"q!", b"a", b"zz", b"k"), frozenset())


def emitted_counts(intersection: Intersection, draft_logits, target_probs, params, num_trials, seed,
                   draft_probs_for_verify=None) -> np.ndarray:
    """Counts of the first emitted token over num_trials one-token drafts."""
    generator = make_generator(seed)
    counts = np.zeros(target_probs.shape[-1], dtype=np.int64)
    draft_probs = intersection.restrict(draft_logits, params)  # [draft_vocab]
    carried = intersection.to_target(draft_probs) if draft_probs_for_verify is None else draft_probs_for_verify
    for _ in range(num_trials):
        draft_token = int(sample(draft_probs, generator))
        target_token = intersection.draft_to_target[draft_token].view(1)  # [1]
        verdict = verify_rejection(target_token, carried[None], target_probs, generator)
        counts[target_token.item() if verdict.num_accepted else verdict.next_token] += 1
    return counts


CASES = {
    # name: (target vocabulary, draft vocabulary, sampling params, draft logits bias outside the intersection)
    "partial-overlap-temperature-1": (TARGET, DRAFT, SamplingParams(temperature=1.0), 0.0),
    "partial-overlap-top-k-4": (TARGET, DRAFT, SamplingParams(temperature=0.8, top_k=4), 0.0),
    "draft-prefers-tokens-outside-the-intersection": (TARGET, DRAFT, SamplingParams(temperature=1.0), 8.0),
    "small-draft-large-target-top-p": (BIG_TARGET, SMALL_DRAFT, SamplingParams(temperature=1.0, top_p=0.9), 0.0),
}


def make_case(target_vocab, draft_vocab, params, outside_bias, seed=0):
    generator = torch.Generator().manual_seed(seed)
    vocabulary_map = build_vocabulary_map(target_vocab, draft_vocab)
    intersection = Intersection(vocabulary_map.draft_to_target, len(target_vocab.spellings))
    draft_logits = torch.randn(len(draft_vocab.spellings), generator=generator) * 1.5
    draft_logits += outside_bias * (~vocabulary_map.in_intersection).float()  # [draft_vocab]
    target_logits = torch.randn(2, len(target_vocab.spellings), generator=generator) * 1.5
    return intersection, draft_logits, logits_to_probs(target_logits, params)  # target_probs [2, target_vocab]


@pytest.mark.parametrize("case", list(CASES))
def test_intersection_drafts_emit_the_target_distribution(case):
    target_vocab, draft_vocab, params, outside_bias = CASES[case]
    intersection, draft_logits, target_probs = make_case(target_vocab, draft_vocab, params, outside_bias)
    draft_probs = intersection.restrict(draft_logits, params)
    # The draft never proposes a token without a target twin, and its carried distribution sums to 1.
    assert float(draft_probs[~(intersection.draft_to_target >= 0)].sum()) == 0.0
    assert float(intersection.to_target(draft_probs).sum()) == pytest.approx(1.0, abs=1e-6)
    vocab = target_probs.shape[-1]
    counts = emitted_counts(intersection, draft_logits, target_probs, params, required_samples(vocab), seed=1)
    assert chi_square_p_value(counts, target_probs[0].numpy()) > ALPHA


def test_two_draft_tokens_spelling_one_target_token_add_their_probabilities():
    vocabulary_map = build_vocabulary_map(TARGET, DRAFT)
    assert vocabulary_map.draft_to_target.tolist() == [0, -1, 1, 3, -1, 0, -1, 2, 5]
    intersection = Intersection(vocabulary_map.draft_to_target, len(TARGET.spellings))
    draft_probs = torch.tensor([0.1, 0.0, 0.2, 0.1, 0.0, 0.3, 0.0, 0.2, 0.1])
    assert intersection.to_target(draft_probs).tolist() == pytest.approx([0.4, 0.2, 0.2, 0.1, 0.0, 0.1, 0.0])


def test_negative_control_unrenormalised_draft_probabilities_are_rejected():
    params = SamplingParams(temperature=1.0)
    intersection, draft_logits, target_probs = make_case(TARGET, DRAFT, params, outside_bias=1.5, seed=3)
    # The bug: verify with the draft's UNRESTRICTED probabilities of the shared tokens (they
    # sum to less than 1), while drafts are sampled from the restricted distribution.
    unrestricted = logits_to_probs(draft_logits, params)
    buggy_carried = intersection.to_target(unrestricted)
    restricted = intersection.to_target(intersection.restrict(draft_logits, params))
    target0 = target_probs[0].double()
    accept = torch.minimum(torch.ones_like(target0), target0 / buggy_carried.double().clamp_min(1e-30))
    accepted_mass = restricted.double() * accept
    residual = (target0 - buggy_carried.double()).clamp_min(0)
    buggy = accepted_mass + (1 - accepted_mass.sum()) * residual / residual.sum()
    assert cohens_w(buggy.numpy(), target0.numpy()) >= EFFECT_SIZE  # the test has the power to see it
    vocab = target_probs.shape[-1]
    counts = emitted_counts(intersection, draft_logits, target_probs, params, required_samples(vocab), seed=1,
                            draft_probs_for_verify=buggy_carried)
    assert chi_square_p_value(counts, target_probs[0].numpy()) < ALPHA


def test_real_pair_at_one_position_emits_the_targets_distribution(qwen_0_5b, smollm2):
    """Qwen2.5-Coder-0.5B target, SmolLM2-135M draft, a real chat prompt: the draft's and the
    target's real next-token distributions, sampled and verified through the drafter's path."""
    params = SamplingParams(temperature=1.0, top_k=8, sampling_mode="rejection")  # the draft samples from its own q
    drafter = CrossVocabDrafter(smollm2.model, smollm2.tokenizer, qwen_0_5b.tokenizer,
                                qwen_0_5b.model.info.vocab_size, method="intersection")
    drafter.begin(params, make_generator(0), max_length=256)
    context = torch.tensor(Engine(qwen_0_5b).encode([{"role": "user", "content": "Name a colour of the sky."}]))
    # One real proposal: a target id, with the draft distribution carried to target ids.
    draft = drafter.propose(context, 1)
    assert draft.probs.shape == (1, qwen_0_5b.model.info.vocab_size)
    assert float(draft.probs[0, draft.tokens[0]]) > 0
    cache = qwen_0_5b.model.new_cache(256)
    target_logits = qwen_0_5b.model.forward(context, torch.arange(context.shape[0]), cache, num_logits=1)
    target_probs = logits_to_probs(torch.cat((target_logits, target_logits)), params)  # [2, vocab]: row 1 unused
    # The draft's next-token logits for the same text, as the drafter computes them.
    draft_ids = torch.tensor(drafter.cached_ids)
    draft_cache = smollm2.model.new_cache(256)
    draft_logits = smollm2.model.forward(draft_ids, torch.arange(draft_ids.shape[0]), draft_cache, num_logits=1)[-1]
    assert torch.allclose(drafter.intersection.to_target(drafter.intersection.restrict(draft_logits, params)),
                          draft.probs[0], atol=1e-5)
    # The two models disagree enough for rejections (and so the residual) to matter.
    carried = draft.probs[0]  # [vocab]
    assert float(torch.minimum(target_probs[0], carried).sum()) < 0.95
    # Trials run on the union of both supports (top-k 8 each): the same distributions, without
    # sampling 151936-wide rows thousands of times.
    union = ((target_probs[0] > 0) | (carried > 0)).nonzero().squeeze(1)
    compact = Intersection(torch.arange(union.shape[0]), union.shape[0])
    num_categories = int((target_probs[0] > 0).sum())
    counts = emitted_counts(compact, carried[union].log(), target_probs[:, union], SamplingParams(temperature=1.0),
                            required_samples(num_categories), seed=2)
    assert chi_square_p_value(counts, target_probs[0, union].numpy()) > ALPHA
