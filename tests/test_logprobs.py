"""Log-probabilities of generated tokens (SamplingParams.logprobs) on the real SmolLM2-135M.

What they must be: the model's own numbers at each position, log_softmax of the target's logits,
so the same floats whichever drafter ran, in a batch or alone, streamed or not, and the same as
one forward over the prompt and the whole output computes (batch invariance makes a verify
row, a decode row and a prefill row the same bits).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

import draftwise
from draftwise import SamplingParams
from draftwise.drafters.ngram import NgramDrafter
from draftwise.engine import Engine, NoDrafter
from draftwise.errors import ConfigError
from draftwise.logprobs import TokenLogprob, token_bytes
from tests.conftest import PROMPTS
from tests.test_batch_step import _decode_together

CASES = [PROMPTS[i] for i in (1, 4, 9)]  # a code edit, a summary, a math question


@pytest.fixture(scope="module")
def engines():
    """The default weights and activations, one engine per drafter (chains and trees)."""
    return {name: draftwise.load("smollm2-135m", drafter=name, progress=False)
            for name in ("none", "ngram", "eagle", "medusa")}


def _reference(engine: Engine, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
    """Each output token's log-probability from ONE forward over prompt + output."""
    ids = prompt_ids + token_ids
    model = engine.target.model
    logits = model.forward(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(len(ids) + 1))
    start = len(ids) - len(token_ids) - 1  # the row that predicts the first output token
    return [float(torch.log_softmax(logits[start + i], dim=-1)[token]) for i, token in enumerate(token_ids)]


@pytest.mark.parametrize("prompt", CASES, ids=["code edit", "summary", "math"])
def test_greedy_logprobs_are_the_same_floats_with_every_drafter_and_equal_one_forward_over_the_text(engines, prompt):
    plain = engines["none"].generate(prompt, max_new_tokens=40, logprobs=4)
    assert len(plain.logprobs) == len(plain.token_ids) > 0
    assert [entry.token_id for entry in plain.logprobs] == plain.token_ids
    assert [entry.logprob for entry in plain.logprobs] == _reference(engines["none"], engines["none"].encode(prompt), plain.token_ids)
    accepted = 0
    for name in ("ngram", "eagle", "medusa"):
        result = engines[name].generate(prompt, max_new_tokens=40, logprobs=4)
        assert result.token_ids == plain.token_ids, name
        assert result.logprobs == plain.logprobs, name  # ids, logprobs and alternatives, bit for bit
        accepted += result.metrics.num_accepted_tokens
    assert accepted > 0  # drafts were accepted: rows of verify forwards were really used
    for entry in plain.logprobs:  # greedy: the chosen token is the most probable; alternatives sorted
        assert len(entry.top) == 4 and entry.top[0] == (entry.token_id, entry.logprob)
        assert [logprob for _, logprob in entry.top] == sorted((logprob for _, logprob in entry.top), reverse=True)
        assert entry.logprob <= 0.0


def test_seeded_sampling_reports_the_models_logprobs_of_the_sampled_tokens_whatever_the_drafter(engines):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_new_tokens=32, logprobs=2)
    plain = engines["none"].generate(PROMPTS[0], params)
    for name in ("ngram", "eagle"):
        result = engines[name].generate(PROMPTS[0], params)
        assert result.token_ids == plain.token_ids and result.logprobs == plain.logprobs, name
    # The raw model's numbers, not the sampler's: temperature and top-p do not enter them.
    assert [entry.logprob for entry in plain.logprobs] == _reference(engines["none"], engines["none"].encode(PROMPTS[0]), plain.token_ids)
    assert any(entry.token_id != entry.top[0][0] for entry in plain.logprobs)  # it sampled, not argmaxed


def test_in_a_batch_each_requests_logprobs_equal_its_own_alone(smollm2):
    ngram = NgramDrafter(1, 3)
    engine = Engine(smollm2, ngram, 10)
    plain = Engine(smollm2)
    jobs = [(PROMPTS[i], SamplingParams(max_new_tokens=24, logprobs=1), [NoDrafter(), ngram][i % 2], None)
            for i in range(5)]
    together = _decode_together(engine, jobs, join_steps=[0, 0, 2, 3, 3])
    for (prompt, params, _, _), result in zip(jobs, together):
        assert result.logprobs == plain.generate(prompt, params).logprobs


def test_streamed_logprobs_add_up_to_the_results_and_stop_with_the_text(engines):
    engine = engines["ngram"]
    updates = list(engine.stream(PROMPTS[7], max_new_tokens=48, logprobs=1))
    result = updates[-1].result
    assert [entry for update in updates for entry in update.logprobs] == result.logprobs
    assert len(updates) > 2  # really streamed in pieces
    stopped = engine.generate(PROMPTS[7], max_new_tokens=48, logprobs=0, stop=["\n"])
    assert stopped.finish_reason == "stop" and len(stopped.logprobs) == len(stopped.token_ids) < len(result.token_ids)
    assert all(entry.top == () for entry in stopped.logprobs)  # logprobs=0: no alternatives
    assert [(e.token_id, e.logprob) for e in stopped.logprobs] == \
        [(e.token_id, e.logprob) for e in result.logprobs[:len(stopped.logprobs)]]
    assert engine.generate(PROMPTS[7], max_new_tokens=8).logprobs is None  # not asked: not computed


@settings(max_examples=40, deadline=None)
@example(size=4097, k=18, seed=0, levels=0)  # 17 chunks, k = 18: the case CI's run found
@given(size=st.one_of(st.integers(4097, 4400), st.integers(4401, 20000)), k=st.integers(1, 20),
       seed=st.integers(0, 10**6), levels=st.sampled_from([0, 3, 50]))
def test_two_stage_top_k_finds_torch_topks_values(size, k, seed, levels):
    """Rows as long as a vocabulary, with many exact ties where levels > 0 (values rounded to a
    few levels), and rows of fewer 256-token chunks than k (CI's hypothesis run found that case:
    17 chunks, k = 18): the same values as torch.topk, in order, at distinct ids that hold them."""
    from draftwise.logprobs import top_k

    row = torch.randn(size, generator=torch.Generator().manual_seed(seed))
    if levels:
        row = torch.round(row * levels) / levels
    values, ids = top_k(row, k)
    assert torch.equal(values, torch.topk(row, k).values)
    assert torch.equal(row[ids], values) and len(set(ids.tolist())) == k


def test_logprobs_in_the_result_dict_and_bad_counts_refused():
    result = draftwise.engine.GenerationResult("a", [5], "length", draftwise.metrics.RequestMetrics(),
                                               [TokenLogprob(5, -0.25, ((5, -0.25), (6, -2.0)))])
    assert result.to_dict()["logprobs"] == [{"token_id": 5, "logprob": -0.25, "top_logprobs": [
        {"token_id": 5, "logprob": -0.25}, {"token_id": 6, "logprob": -2.0}]}]
    for bad in (-1, 21):
        with pytest.raises(ConfigError, match="logprobs"):
            SamplingParams(logprobs=bad)


@pytest.mark.parametrize("tokenizer_fixture", ["smollm2_tokenizer", "qwen_tokenizer", "gemma_tokenizer"])
def test_token_bytes_join_into_the_text_even_across_a_split_character(request, tokenizer_fixture):
    """Byte-level BPE (SmolLM2, Qwen) cuts an emoji into tokens that each decode to U+FFFD; their
    bytes must still be exact. Gemma's vocabulary is SentencePiece (U+2581 spaces, <0xNN> bytes)."""
    tokenizer = request.getfixturevalue(tokenizer_fixture)
    text = "Héllo wörld 🎉 — naïve café\n  def f(x): return x**2  # 中文 \U0001f9ec"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [token_bytes(tokenizer, token) for token in ids]
    assert b"".join(pieces).decode() == text
    if tokenizer_fixture != "gemma_tokenizer":
        assert any(piece.decode("utf-8", errors="replace") == "\ufffd" * len(piece) for piece in pieces)


def test_prompt_logprobs_score_a_text_as_one_forward_does_in_chunks_and_with_nothing_generated(engines, smollm2):
    """prompt_logprobs: each prompt token's log-probability given those before it (the first has
    none), the numbers one forward over the text computes, whether the prompt is prefilled whole
    or in 16-token chunks beside other requests; max_new_tokens=0 scores without generating."""
    engine = engines["eagle"]
    text = PROMPTS[2] + "    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    ids = engine.encode(text)
    scored = engine.generate(text, max_new_tokens=0, prompt_logprobs=2)
    assert scored.token_ids == [] and scored.text == "" and scored.finish_reason == "length"
    entries = scored.prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None
    assert [entry.token_id for entry in entries[1:]] == ids[1:]
    assert [entry.logprob for entry in entries[1:]] == _reference(engine, ids[0:1], ids[1:])
    assert all(len(entry.top) == 2 for entry in entries[1:])
    # The model finds its own code likely: most of the function's tokens are its first choice.
    assert sum(entry.top[0][0] == entry.token_id for entry in entries[1:]) > len(ids) // 2

    generated = engine.generate(text, max_new_tokens=6, prompt_logprobs=2, logprobs=0)
    assert generated.prompt_logprobs == entries and len(generated.logprobs) == len(generated.token_ids) == 6

    plain = Engine(smollm2)
    params = SamplingParams(max_new_tokens=3, prompt_logprobs=1)
    alone = plain.generate(text, params)
    jobs = [(text, params, NoDrafter(), None), (PROMPTS[0], SamplingParams(max_new_tokens=12), NoDrafter(), None)]
    chunked = _decode_together(plain, jobs, join_steps=[1, 0], prefill_chunk=16)[0]
    assert chunked.prompt_logprobs == alone.prompt_logprobs
    assert [e.logprob for e in alone.prompt_logprobs[1:]] == _reference(plain, ids[0:1], ids[1:])
    with pytest.raises(ConfigError, match="0 only scores"):
        SamplingParams(max_new_tokens=0)
