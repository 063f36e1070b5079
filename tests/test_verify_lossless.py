"""Rejection sampling is lossless: emitted tokens follow the target distribution.

Design of the test. For each case, target and draft distributions are fixed per position (so
the target's next-token distribution does not depend on earlier tokens), drafts are drawn from
the draft distributions, and the verifier decides. The first emitted token must follow
target_probs[0]; given that the first draft token was accepted, the second emitted token must
follow target_probs[1]. A Pearson chi-square goodness-of-fit test at ALPHA checks each.

Power: the sample size is chosen so that a deviation of Cohen's effect size EFFECT_SIZE
(w = sqrt(sum((observed - expected)^2 / expected)) in probabilities) is detected with
probability >= POWER; `required_samples` computes it from the noncentral chi-square
distribution. A negative control (a classic bug: resampling from the target instead of the
residual after a rejection) must be rejected by the very same test.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from scipy import stats

from draftwise.config import SamplingParams
from draftwise.sampling import logits_to_probs, make_generator, sample
from draftwise.verify import Verdict, verify_rejection

ALPHA = 1e-3  # chance that a correct verifier fails a check
EFFECT_SIZE = 0.06  # smallest deviation (Cohen's w) the test must catch ...
POWER = 0.99  # ... with at least this probability
VOCAB = 6


def required_samples(num_categories: int) -> int:
    """Smallest n with P(reject | deviation of size EFFECT_SIZE) >= POWER."""
    df = num_categories - 1
    critical = stats.chi2.ppf(1 - ALPHA, df)
    n = 100
    while stats.ncx2.sf(critical, df, n * EFFECT_SIZE**2) < POWER:
        n = int(n * 1.1) + 1
    return n


def chi_square_p_value(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    support = expected_probs > 0
    # A token the target forbids (filtered by top-k/top-p/min-p) must never be emitted.
    assert counts[~support].sum() == 0, f"emitted a token of target probability 0: {counts}"
    if support.sum() == 1:
        return 1.0  # all mass on one token: the assertion above was the whole test
    expected = expected_probs[support].astype(np.float64)
    expected /= expected.sum()  # float32 probabilities sum to 1 only up to rounding
    return stats.chisquare(counts[support], counts[support].sum() * expected).pvalue


def cohens_w(probs: np.ndarray, expected_probs: np.ndarray) -> float:
    support = expected_probs > 0
    return float(np.sqrt((((probs - expected_probs) ** 2)[support] / expected_probs[support]).sum()))


def make_case(params: SamplingParams, seed: int, point_mass: bool):
    generator = torch.Generator().manual_seed(seed)
    num_draft = 3
    target_logits = torch.randn(num_draft + 1, VOCAB, generator=generator) * 1.5
    target_probs = logits_to_probs(target_logits, params)  # [k + 1, vocab]
    if point_mass:
        draft_probs = None
        fixed_draft = torch.tensor([1, 3, 0])  # an n-gram style guess, sometimes filtered out
    else:
        draft_logits = torch.randn(num_draft, VOCAB, generator=generator) * 1.5
        draft_probs = logits_to_probs(draft_logits, params)  # the drafter samples under the same params
        fixed_draft = None
    return target_probs, draft_probs, fixed_draft


def run_trials(verifier, target_probs, draft_probs, fixed_draft, num_trials: int, seed: int):
    generator = make_generator(seed)
    first = np.zeros(VOCAB, dtype=np.int64)
    second = np.zeros(VOCAB, dtype=np.int64)
    for _ in range(num_trials):
        draft = fixed_draft if draft_probs is None else sample(draft_probs, generator)
        verdict = verifier(draft, draft_probs, target_probs, generator)
        emitted = draft[: verdict.num_accepted].tolist() + [verdict.next_token]
        first[emitted[0]] += 1
        if verdict.num_accepted >= 1:
            second[emitted[1]] += 1
    return first, second


def verify_resampling_from_target(draft_tokens, draft_probs, target_probs, generator) -> Verdict:
    """NEGATIVE CONTROL: after a rejection, draws from target_probs instead of the residual.
    This over-weights tokens the drafter likes, so emitted tokens no longer follow the target."""
    verdict = verify_rejection(draft_tokens, draft_probs, target_probs, generator)
    if verdict.num_accepted == draft_tokens.shape[0]:
        return verdict
    return Verdict(verdict.num_accepted, int(sample(target_probs[verdict.num_accepted], generator)))


CASES = {
    "temperature-1": (SamplingParams(temperature=1.0), False),
    "temperature-0.7-top-k-3": (SamplingParams(temperature=0.7, top_k=3), False),
    "top-p-0.8": (SamplingParams(temperature=1.0, top_p=0.8), False),
    "min-p-0.15": (SamplingParams(temperature=1.0, min_p=0.15), False),
    "point-mass-draft": (SamplingParams(temperature=1.0), True),
    "point-mass-draft-top-k-2": (SamplingParams(temperature=1.0, top_k=2), True),
}


def test_sample_size_gives_the_stated_power():
    n = required_samples(VOCAB)
    df = VOCAB - 1
    power = stats.ncx2.sf(stats.chi2.ppf(1 - ALPHA, df), df, n * EFFECT_SIZE**2)
    assert power >= POWER and n < 20_000


@pytest.mark.parametrize("case", list(CASES))
def test_emitted_tokens_follow_target_distribution(case):
    params, point_mass = CASES[case]
    # A stable seed (str hashes change between processes) makes every run test the same case.
    target_probs, draft_probs, fixed_draft = make_case(params, seed=zlib.crc32(case.encode()), point_mass=point_mass)
    # The first position must leave a real goodness-of-fit test (two tokens or more).
    assert int((target_probs[0] > 0).sum()) >= 2
    num_trials = required_samples(VOCAB)
    first, second = run_trials(verify_rejection, target_probs, draft_probs, fixed_draft, num_trials, seed=7)
    assert chi_square_p_value(first, target_probs[0].numpy()) > ALPHA
    # The second position is only reached after an acceptance: check it when it was reached
    # often enough for the stated power.
    if second.sum() >= required_samples(VOCAB):
        assert chi_square_p_value(second, target_probs[1].numpy()) > ALPHA


def test_bonus_token_after_full_acceptance_follows_target_distribution():
    params = SamplingParams(temperature=1.0)
    target_probs, _, _ = make_case(params, seed=3, point_mass=False)
    # A draft equal to the target's own distribution is always accepted: every emitted
    # token past the draft is a bonus token, which must follow target_probs[k].
    draft_probs = target_probs[:-1].clone()
    generator = make_generator(11)
    counts = np.zeros(VOCAB, dtype=np.int64)
    for _ in range(required_samples(VOCAB)):
        verdict = verify_rejection(sample(draft_probs, generator), draft_probs, target_probs, generator)
        assert verdict.num_accepted == 3
        counts[verdict.next_token] += 1
    assert chi_square_p_value(counts, target_probs[3].numpy()) > ALPHA


def test_negative_control_wrong_residual_is_rejected_by_the_same_test():
    params = SamplingParams(temperature=1.0)
    target_probs, draft_probs, _ = make_case(params, seed=5, point_mass=False)
    target0, draft0 = target_probs[0].numpy(), draft_probs[0].numpy()
    # The buggy rule emits min(p, q) + (1 - sum min(p, q)) * p: far enough from p to matter.
    overlap = np.minimum(target0, draft0)
    buggy = overlap + (1 - overlap.sum()) * target0
    assert cohens_w(buggy, target0) >= EFFECT_SIZE
    first, _ = run_trials(verify_resampling_from_target, target_probs, draft_probs, None,
                          required_samples(VOCAB), seed=7)
    assert chi_square_p_value(first, target0) < ALPHA
