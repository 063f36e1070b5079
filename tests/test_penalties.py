"""Repetition penalties (presence, frequency, repetition) under speculation, on the real SmolLM2-135M.

A penalty makes each position's distribution depend on the tokens before it, so a verify row
must be penalised by its own path's tokens. What must hold: plain decoding with a penalty is
the textbook definition (transformers' RepetitionPenaltyLogitsProcessor; OpenAI's formula for
presence and frequency); every drafter, chains and trees, gives the same output; a seeded
coupled sample is the same text; and each row of a penalised verify equals the same row
penalised alone with its path as context.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import draftwise
from draftwise import SamplingParams
from draftwise.errors import ConfigError
from draftwise.penalties import penalize
from draftwise.tree import ancestor_mask
from tests.conftest import PROMPTS

CASES = [PROMPTS[2], PROMPTS[8], PROMPTS[1]]  # code, a list, a code edit: outputs that repeat
# Penalties that change every case's greedy output yet leave drafts worth accepting: at 1.3 the
# repetition penalty left SmolLM2's drafters 0-12 accepted tokens in all, 0 on one CI machine's
# float32 rounding; at 1.1 they accept 20-77 under every activation setting (AMX Xeon, measured).
PENALTIES = [{"repetition_penalty": 1.1}, {"frequency_penalty": 0.8, "presence_penalty": 0.5}]


@pytest.fixture(scope="module")
def engines():
    return {name: draftwise.load("smollm2-135m", drafter=name, progress=False)
            for name in ("none", "ngram", "eagle", "medusa")}


def _reference(engine, prompt, num_tokens: int, penalties: dict) -> list[int]:
    """Greedy decoding by the definition: the model's logits for the next token (one forward per
    token over a cache, no drafts), then the textbook penalty, then argmax."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    model = engine.target.model
    ids, out = engine.encode(prompt), []
    cache = model.new_cache(len(ids) + num_tokens)
    logits = model.forward(torch.tensor(ids), torch.arange(len(ids)), cache)[-1:]
    for _ in range(num_tokens):
        full = ids + out
        if out:
            logits = model.forward(torch.tensor(out[-1:]), torch.tensor([len(full) - 1]), cache)
        if "repetition_penalty" in penalties:
            logits = RepetitionPenaltyLogitsProcessor(penalties["repetition_penalty"])(torch.tensor([full]), logits.clone())
        else:
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[-1]).float()
            logits = logits - penalties["frequency_penalty"] * counts - penalties["presence_penalty"] * (counts > 0).float()
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("penalties", PENALTIES, ids=["repetition", "frequency+presence"])
def test_greedy_with_penalties_is_the_definition_and_every_drafter_gives_it(engines, penalties):
    changed, accepted = 0, dict.fromkeys(("ngram", "eagle", "medusa"), 0)
    for prompt in CASES:
        plain = engines["none"].generate(prompt, max_new_tokens=40, **penalties)
        assert plain.token_ids == _reference(engines["none"], prompt, len(plain.token_ids), penalties)
        changed += plain.token_ids != engines["none"].generate(prompt, max_new_tokens=40).token_ids
        for name in accepted:
            result = engines[name].generate(prompt, max_new_tokens=40, **penalties)
            assert result.token_ids == plain.token_ids, name
            accepted[name] += result.metrics.num_accepted_tokens
    assert changed >= 2  # the penalty really changed outputs
    assert all(accepted.values()), accepted  # and every drafter's drafts (chains and trees) were verified under it


def test_a_seeded_sample_with_penalties_is_the_same_text_with_every_drafter(engines):
    params = SamplingParams(temperature=0.8, seed=11, max_new_tokens=40, repetition_penalty=1.2, frequency_penalty=0.3)
    plain = engines["none"].generate(PROMPTS[0], params)
    for name in ("ngram", "eagle"):
        assert engines[name].generate(PROMPTS[0], params).token_ids == plain.token_ids, name


def test_logit_bias_bans_and_forces_tokens_and_every_drafter_gives_the_same_output(engines):
    prompt = PROMPTS[2]
    unbiased = engines["none"].generate(prompt, max_new_tokens=24).token_ids
    banned = {token: -100.0 for token in set(unbiased[:4])}  # the first tokens plain decoding chose
    plain = engines["none"].generate(prompt, max_new_tokens=24, logit_bias=banned)
    assert not set(plain.token_ids) & set(banned) and plain.token_ids != unbiased
    for name in ("ngram", "eagle"):
        assert engines[name].generate(prompt, max_new_tokens=24, logit_bias=banned).token_ids == plain.token_ids, name
    forced = engines["eagle"].generate(prompt, max_new_tokens=6, logit_bias={unbiased[5]: 100.0})
    assert forced.token_ids == [unbiased[5]] * 6
    with pytest.raises(ConfigError, match="vocabulary"):
        engines["none"].generate(prompt, max_new_tokens=2, logit_bias={10**7: 1.0})


def test_min_new_tokens_and_ignore_eos_move_the_end_and_every_drafter_follows(engines):
    """The chat answer ends (EOS) after n tokens. min_new_tokens = n + 6 bans the end until then
    (rows of a draft deeper than the count are free again), ignore_eos writes through it."""
    prompt = [{"role": "user", "content": "Say hi."}]
    ended = engines["none"].generate(prompt, max_new_tokens=48)
    n = len(ended.token_ids)
    assert ended.finish_reason == "stop" and n + 12 <= 48
    longer = engines["none"].generate(prompt, max_new_tokens=48, min_new_tokens=n + 6)
    assert len(longer.token_ids) >= n + 6 and longer.token_ids[:n] == ended.token_ids
    through = engines["none"].generate(prompt, max_new_tokens=n + 12, ignore_eos=True)
    assert len(through.token_ids) == n + 12 and through.token_ids[n] in engines["none"].target.model.info.eos_token_ids
    for name in ("ngram", "eagle", "medusa"):
        assert engines[name].generate(prompt, max_new_tokens=48, min_new_tokens=n + 6).token_ids == longer.token_ids
        assert engines[name].generate(prompt, max_new_tokens=n + 12, ignore_eos=True).token_ids == through.token_ids
    with pytest.raises(ConfigError, match="min_new_tokens"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_each_penalised_row_is_that_row_penalised_alone_with_its_path_as_context(data):
    """Random trees over a small vocabulary: row r of one penalize call equals penalize of row r
    alone with the draft tokens on r's path appended to the context, bit for bit."""
    vocab = 12
    num_prompt = data.draw(st.integers(1, 6))
    context = torch.tensor(data.draw(st.lists(st.integers(0, vocab - 1), min_size=num_prompt, max_size=num_prompt + 6)))
    num_nodes = data.draw(st.integers(0, 7))
    parents = [data.draw(st.integers(-1, node - 1)) for node in range(num_nodes)]
    draft = torch.tensor(data.draw(st.lists(st.integers(0, vocab - 1), min_size=num_nodes, max_size=num_nodes)),
                         dtype=torch.long)
    params = SamplingParams(logit_bias={data.draw(st.integers(0, vocab - 1)): data.draw(st.sampled_from([0.0, -3.5]))},
                            repetition_penalty=data.draw(st.sampled_from([1.0, 1.3, 0.7])),
                            frequency_penalty=data.draw(st.sampled_from([0.0, 0.6, -1.1])),
                            presence_penalty=data.draw(st.sampled_from([0.0, 0.4])))
    logits = torch.randn(num_nodes + 1, vocab, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    mask = ancestor_mask(torch.tensor(parents, dtype=torch.long))
    together = penalize(logits, params, context, num_prompt, draft, mask)
    for row in range(num_nodes + 1):
        path = draft[[node for node in range(num_nodes) if mask[row, node + 1]]]
        alone = penalize(logits[row:row + 1], params, torch.cat((context, path)), num_prompt, draft[:0])
        assert torch.equal(together[row], alone[0])
    if num_nodes and params.has_penalties:  # and a chain is the causal special case
        chain = penalize(logits, params, context, num_prompt, draft)
        assert torch.equal(chain, penalize(logits, params, context, num_prompt, draft,
                                           ancestor_mask(torch.arange(-1, num_nodes - 1))))


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                          ("repetition_penalty", 0.0), ("repetition_penalty", float("nan")),
                                          ("logit_bias", {5: 150.0}), ("logit_bias", {-1: 1.0})])
def test_out_of_range_penalties_are_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**{field: value})
