"""Greedy speculative decoding is exactly plain greedy decoding, on the real SmolLM2-135M.

Run in float32: in bfloat16 a k-token verify forward and k one-token forwards round
differently, so a near-tie between two tokens can flip and outputs legitimately diverge.
"""

from __future__ import annotations

import pytest

from draftwise.bench.methods import TransformersMethod
from draftwise.config import SamplingParams
from draftwise.drafters import ModelDrafter, NgramDrafter
from draftwise.draft_length import DraftLengthPolicy
from draftwise.engine import Engine
from tests.conftest import PROMPTS

PARAMS = SamplingParams(max_new_tokens=24)
DRAFT_LAYERS = 27  # the target's first 27 of 30 layers: agrees often, not always


@pytest.fixture(scope="module")
def plain_outputs(smollm2) -> list[list[int]]:
    engine = Engine(smollm2)
    return [engine.generate(prompt, PARAMS).token_ids for prompt in PROMPTS]


@pytest.fixture(scope="module")
def truncated_drafter(smollm2) -> ModelDrafter:
    return ModelDrafter(smollm2.model.truncated(DRAFT_LAYERS))


def test_plain_greedy_matches_transformers_generate(smollm2, hf_smollm2, plain_outputs):
    # transformers' greedy `generate` on the same token ids, cut before EOS as draftwise's output is.
    transformers_greedy = TransformersMethod("transformers plain", hf_smollm2, Engine(smollm2).encode,
                                             smollm2.model.info.eos_token_ids)
    for prompt, ours in zip(PROMPTS, plain_outputs):
        reference = transformers_greedy.run(prompt, PARAMS.max_new_tokens).token_ids
        assert ours == reference, f"prompt {prompt!r}"


@pytest.mark.parametrize("num_draft_tokens", [1, 3, 8])  # k=5 adds little between 3 and 8 (CI budget)
def test_ngram_drafter_output_equals_plain_greedy(smollm2, plain_outputs, num_draft_tokens):
    engine = Engine(smollm2, NgramDrafter(), num_draft_tokens)
    results = [engine.generate(prompt, PARAMS) for prompt in PROMPTS]
    for prompt, result, expected in zip(PROMPTS, results, plain_outputs):
        assert result.token_ids == expected, f"prompt {prompt!r}"
    assert sum(r.metrics.num_accepted_tokens for r in results) > 0  # speculation really happened


def test_the_float32_weights_path_speculates_the_same_text(smollm2_dense, plain_outputs):
    # `smollm2` runs the GGUF blocks (the same bits, faster); --dtype float32's float weights (the
    # path of HF safetensors models) must give the same text too, drafts rolled back and all.
    engine = Engine(smollm2_dense, NgramDrafter(), 3)
    results = [engine.generate(prompt, PARAMS) for prompt in PROMPTS]
    assert [result.token_ids for result in results] == plain_outputs
    assert sum(r.metrics.num_accepted_tokens for r in results) > 0


# k=3 only here: k=1 and k=8 with this drafter run in the default format (test_batch_invariance.py),
# whose logits are this float32 path's bit for bit (its last test); each k costs 20-50 s of CI.
@pytest.mark.parametrize("num_draft_tokens", [3])
def test_model_drafter_output_equals_plain_greedy(smollm2, plain_outputs, truncated_drafter, num_draft_tokens):
    engine = Engine(smollm2, truncated_drafter, num_draft_tokens)
    results = [engine.generate(prompt, PARAMS) for prompt in PROMPTS]
    for prompt, result, expected in zip(PROMPTS, results, plain_outputs):
        assert result.token_ids == expected, f"prompt {prompt!r}"
    num_proposed = sum(r.metrics.num_draft_tokens for r in results)
    num_accepted = sum(r.metrics.num_accepted_tokens for r in results)
    # Both paths of the verifier were exercised: some drafts kept, some rolled back.
    assert 0 < num_accepted < num_proposed


@pytest.mark.parametrize("drafter_name", ["ngram", "model"])
def test_adaptive_draft_length_output_equals_plain_greedy(smollm2, plain_outputs, truncated_drafter, drafter_name):
    # The policy trims drafts by measured timings, so each run verifies different lengths;
    # whatever it trims, the output must not change.
    drafter = NgramDrafter() if drafter_name == "ngram" else truncated_drafter
    policy = DraftLengthPolicy()
    engine = Engine(smollm2, drafter, 10, policy)
    results = [engine.generate(prompt, PARAMS) for prompt in PROMPTS]
    for prompt, result, expected in zip(PROMPTS, results, plain_outputs):
        assert result.token_ids == expected, f"prompt {prompt!r}"
    assert sum(r.metrics.num_accepted_tokens for r in results) > 0
    assert 1 in policy.forward_s and len(policy.forward_s) > 1  # it measured plain and verify forwards
