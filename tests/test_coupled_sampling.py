"""Coupled sampling: the same seed gives the same text whatever the drafter and draft lengths,
and every emitted token is still an exact sample of the target's distribution.

Equality on the real SmolLM2-135M (float32) over the twelve prompts, temperatures 0.5 and 1.0
with top-p 0.9 and top-k 20 among them: drafter none, ngram, a draft model (the target's first
12 layers), fixed and adaptive draft lengths, k in {1, 3, 8}; and cross-vocab (SmolLM2 drafting
for Qwen2.5-Coder-0.5B, both methods, every k, both draft lengths). Every prompt meets every
drafter. Losslessness: the chi-square design of tests/test_verify_lossless.py
(ALPHA, POWER against EFFECT_SIZE) on the first emitted token over seeds, drafts from a
different distribution; a negative control (a coupled sampler that keeps the draft's own
Gumbel-max token) must be rejected by the same test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draftwise.config import SamplingParams
from draftwise.draft_length import DraftLengthPolicy
from draftwise.drafters import ModelDrafter, NgramDrafter
from draftwise.drafters.base import Draft
from draftwise.engine import Engine
from draftwise.sampling import gumbel_noise, logits_to_probs
from draftwise.step import choose
from tests.conftest import PROMPTS
from tests.test_verify_lossless import ALPHA, chi_square_p_value, required_samples

SETTINGS = [
    dict(temperature=0.5),
    dict(temperature=1.0),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.5, top_k=20),
]
NUM_TOKENS = 12
DRAFT_LAYERS = 12  # a cheap draft: the target's first 12 of 30 layers


def _params(index: int, seed: int = 7) -> SamplingParams:
    return SamplingParams(**SETTINGS[index % len(SETTINGS)], seed=seed + index, max_new_tokens=NUM_TOKENS,
                          sampling_mode="coupled")


@pytest.fixture(scope="module")
def reference(smollm2) -> list[list[int]]:
    plain = Engine(smollm2)
    return [plain.generate(prompt, _params(i)).token_ids for i, prompt in enumerate(PROMPTS)]


CONFIGS = [(drafter, k, length) for drafter in ("ngram", "model") for k in (1, 3, 8) for length in ("fixed", "adaptive")]


@pytest.mark.parametrize("drafter_name, num_draft_tokens, draft_length", CONFIGS)
def test_same_seed_same_tokens_whatever_the_drafter_and_draft_length(smollm2, reference, drafter_name,
                                                                     num_draft_tokens, draft_length):
    """Each configuration decodes a third of the prompts (a different third for neighbouring
    configurations), so every prompt meets every drafter, both draft lengths and every k."""
    drafter = NgramDrafter() if drafter_name == "ngram" else ModelDrafter(smollm2.model.truncated(DRAFT_LAYERS))
    engine = Engine(smollm2, drafter, num_draft_tokens, DraftLengthPolicy() if draft_length == "adaptive" else None)
    offset = CONFIGS.index((drafter_name, num_draft_tokens, draft_length)) % 3
    accepted = 0
    for i in range(offset, len(PROMPTS), 3):
        result = engine.generate(PROMPTS[i], _params(i))
        assert result.token_ids == reference[i], f"prompt {i}"
        accepted += result.metrics.num_accepted_tokens
    if drafter_name == "model" and draft_length == "fixed":
        assert accepted > 0  # every draft is verified: the draft model's coupled guesses do get accepted


def test_same_seed_same_tokens_with_eagle_trees(smollm2, reference):
    from draftwise.drafters.eagle import EagleDrafter
    from draftwise.heads import head_for
    from draftwise.heads.eagle import load_head

    drafter = EagleDrafter(load_head(head_for("smollm2-135m", "eagle"), smollm2.model), smollm2.model)
    engine = Engine(smollm2, drafter, 24, DraftLengthPolicy())
    for i in (0, 4, 7, 11):
        assert engine.generate(PROMPTS[i], _params(i)).token_ids == reference[i], f"prompt {i}"


# Every method and every k, and each k with both draft lengths (across the methods).
CROSS_VOCAB_CONFIGS = [("string", 1, "fixed"), ("string", 3, "adaptive"), ("string", 8, "fixed"),
                       ("intersection", 1, "adaptive"), ("intersection", 3, "fixed"), ("intersection", 8, "adaptive")]


def test_same_seed_same_tokens_with_a_cross_vocabulary_draft(qwen_0_5b, smollm2):
    """SmolLM2 drafting for Qwen2.5-Coder-0.5B: each of the six configurations decodes one of
    the twelve prompts (every other one: CI's time budget; the 0.5B decodes each twice)."""
    from draftwise.drafters.cross_vocab import CrossVocabDrafter

    plain = Engine(qwen_0_5b)
    accepted = 0
    for index, (method, k, length) in enumerate(CROSS_VOCAB_CONFIGS):
        drafter = CrossVocabDrafter(smollm2.model, smollm2.tokenizer, qwen_0_5b.tokenizer,
                                    qwen_0_5b.model.info.vocab_size, method)
        engine = Engine(qwen_0_5b, drafter, k, DraftLengthPolicy() if length == "adaptive" else None)
        for i in (2 * index,):
            params = _params(i)
            result = engine.generate(PROMPTS[i], params)
            assert result.token_ids == plain.generate(PROMPTS[i], params).token_ids, f"{method} k={k} {length} prompt {i}"
            accepted += result.metrics.num_accepted_tokens
    assert accepted > 0


def test_a_different_seed_gives_different_text(smollm2):
    engine = Engine(smollm2, NgramDrafter(), 5)
    texts = {engine.generate(PROMPTS[0], _params(0, seed=seed)).text for seed in (1, 2, 3)}
    assert len(texts) == 3


def test_coupled_mode_without_a_seed_still_samples_and_is_reported_unchanged_to_drafters(smollm2):
    engine = Engine(smollm2, NgramDrafter(), 5)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, sampling_mode="coupled")  # a fresh seed per request
    assert engine.generate(PROMPTS[7], params).token_ids != engine.generate(PROMPTS[7], params).token_ids


# --- losslessness -----------------------------------------------------------------------------

TARGET_LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0]] * 2)  # rows: position t, t + 1
DRAFT_LOGITS = torch.tensor([0.0, 1.0, 2.0, 0.0, 1.5, -1.0, 0.5, 0.0])  # a draft that often disagrees


def _first_tokens(params_for_seed, num_trials: int, cheat: bool = False) -> np.ndarray:
    """Counts of the first emitted token: a one-token draft is proposed as a coupled draft model
    would (argmax of log q + the same noise), then verified by draftwise.step.choose."""
    counts = np.zeros(TARGET_LOGITS.shape[1], dtype=np.int64)
    position = 40
    for seed in range(num_trials):
        params = params_for_seed(seed)
        q = logits_to_probs(DRAFT_LOGITS, params)
        drafted = int((q.log() + gumbel_noise(params.seed, position, q.shape[0])).argmax())
        verdict = choose(Draft(torch.tensor([drafted]), q[None]), TARGET_LOGITS, params, torch.Generator(),
                         [position, position + 1])
        first = drafted if cheat or verdict.num_accepted else verdict.next_token
        counts[first] += 1
    return counts


@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=0.6, top_k=5), dict(temperature=1.3, top_p=0.8)])
def test_every_emitted_token_follows_the_target_distribution(setting):
    num_trials = required_samples(TARGET_LOGITS.shape[1])

    def params(seed):
        return SamplingParams(**setting, seed=seed, sampling_mode="coupled")

    expected = logits_to_probs(TARGET_LOGITS[0], params(0)).numpy()
    support = expected > 0
    counts = _first_tokens(params, num_trials)
    assert counts[~support].sum() == 0  # filtered tokens are never emitted
    assert chi_square_p_value(counts[support], expected[support]) > ALPHA


def test_negative_control_a_sampler_that_keeps_the_draft_token_is_rejected():
    num_trials = required_samples(TARGET_LOGITS.shape[1])

    def params(seed):
        return SamplingParams(temperature=1.0, seed=seed, sampling_mode="coupled")

    expected = logits_to_probs(TARGET_LOGITS[0], params(0)).numpy()
    assert chi_square_p_value(_first_tokens(params, num_trials, cheat=True), expected) < ALPHA
