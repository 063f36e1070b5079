"""The prefix cache: a prompt that starts with tokens an earlier request ran reuses their keys,
values and drafter rows, and decodes exactly what a fresh prefill decodes."""

from __future__ import annotations

import pytest

import draftwise
from draftwise import PrefixCache
from draftwise.engine import Engine

STORY = "Write a short story about a robot who learns to paint, with a twist at the end. " * 8


def _conversation(engine: Engine, turns: int) -> list[draftwise.GenerationResult]:
    messages, results = [{"role": "user", "content": STORY}], []
    for turn in range(turns):
        results.append(engine.generate(messages, max_new_tokens=40))
        messages += [{"role": "assistant", "content": results[-1].text}, {"role": "user", "content": f"Go on ({turn})."}]
    return results


@pytest.mark.parametrize("drafter", ["ngram", "eagle"])
def test_a_conversation_decodes_the_same_tokens_from_the_cached_prefix(drafter):
    """Default weights and activations; EAGLE also gets the cached rows' hidden states."""
    fresh = draftwise.load("smollm2-135m", drafter=drafter, progress=False)
    cached = draftwise.load("smollm2-135m", drafter=drafter, progress=False)
    cached.prefix_cache = PrefixCache(1 << 30)
    expected, got = _conversation(fresh, 3), _conversation(cached, 3)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert got[0].metrics.num_cached_prompt_tokens == 0
    for previous, result in zip(got, got[1:]):
        # everything but the new question: the previous prompt and (re-tokenized) reply
        assert result.metrics.num_cached_prompt_tokens >= previous.metrics.num_prompt_tokens
    assert len(cached.prefix_cache._entries) == 1  # each turn's entry replaced the one it extends
    if drafter == "eagle":  # the head read every cached row: it drafts as well as from a fresh prefill
        assert got[-1].metrics.mean_accepted_length > 1.5


def test_the_same_prompt_again_prefills_only_its_last_token_and_unrelated_prompts_share_the_template(smollm2):
    engine = Engine(smollm2)  # float32 throughout
    engine.prefix_cache = PrefixCache(1 << 30)
    plain = Engine(smollm2)
    question = [{"role": "user", "content": "What is a hash map?"}]
    first, again = engine.generate(question, max_new_tokens=24), engine.generate(question, max_new_tokens=24)
    assert again.token_ids == first.token_ids == plain.generate(question, max_new_tokens=24).token_ids
    assert again.metrics.num_cached_prompt_tokens == again.metrics.num_prompt_tokens - 1
    other = [{"role": "user", "content": "Name three rivers."}]
    shared = engine.generate(other, max_new_tokens=24)
    assert 0 < shared.metrics.num_cached_prompt_tokens < shared.metrics.num_prompt_tokens - 2  # the chat template's start
    assert shared.token_ids == plain.generate(other, max_new_tokens=24).token_ids


def test_the_cache_stays_within_its_budget_dropping_the_least_recently_used(smollm2):
    engine = Engine(smollm2)
    engine.prefix_cache = PrefixCache(1 << 30)
    engine.generate("Apples and pears make the first prompt.", max_new_tokens=8)
    one_entry = engine.prefix_cache.num_bytes
    engine.prefix_cache = PrefixCache(int(2.5 * one_entry))
    prompts = ["Apples and pears make the first prompt.", "Rivers of Europe make a second one.",  # no token in common
               "Moon phases are the third prompt's topic."]
    for prompt in prompts:
        engine.generate(prompt, max_new_tokens=8)
    assert engine.prefix_cache.num_bytes <= int(2.5 * one_entry)
    kept = [engine.tokenizer.decode(entry.tokens) for entry in engine.prefix_cache._entries]
    assert len(kept) == 2 and kept[0].startswith(prompts[1]) and kept[1].startswith(prompts[2])
    assert engine.generate(prompts[2], max_new_tokens=8).metrics.num_cached_prompt_tokens > 5
    engine.prefix_cache = PrefixCache(one_entry // 2)  # an entry bigger than the whole budget is not kept
    engine.generate(prompts[0], max_new_tokens=8)
    assert engine.prefix_cache.num_bytes == 0


def test_a_draft_models_next_turn_feeds_only_what_its_cache_does_not_hold(monkeypatch):
    """The draft model keeps its entries between requests: a conversation's next turn feeds it
    the new tokens only, and it drafts what a fresh draft cache drafts (fixed draft lengths, so
    the drafts are compared one for one)."""
    from draftwise.drafters import draft_model

    fed_rows = []
    forward = draft_model.forward_segments

    def counting(model, segments, *args):
        fed_rows.append(sum(segment.tokens.shape[0] for segment in segments))
        return forward(model, segments, *args)

    kept = draftwise.load("smollm2-135m", drafter="model", draft_model="smollm2-135m", num_draft_tokens=3,
                          draft_length="fixed", progress=False)
    kept.prefix_cache = PrefixCache(1 << 30)  # prefix caching: the target's and the draft model's
    fresh = draftwise.load("smollm2-135m", drafter="model", draft_model="smollm2-135m", num_draft_tokens=3,
                           draft_length="fixed", progress=False)
    messages = [{"role": "user", "content": STORY}]
    first = kept.generate(messages, max_new_tokens=24)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Go on."}]
    monkeypatch.setattr(draft_model, "forward_segments", counting)
    second = kept.generate(messages, max_new_tokens=24)
    catch_up = fed_rows[0]  # the request's first draft forward: what the cache did not hold
    monkeypatch.setattr(draft_model, "forward_segments", forward)
    kept.drafter.fed = draft_model.NOTHING_FED  # as a fresh cache would start
    again = kept.generate(messages, max_new_tokens=24)  # (the target's prefix cache is exact: tested above)
    expected = fresh.generate(messages, max_new_tokens=24)
    assert second.token_ids == again.token_ids == expected.token_ids
    assert second.metrics.num_accepted_tokens == expected.metrics.num_accepted_tokens
    assert catch_up < second.metrics.num_prompt_tokens - first.metrics.num_prompt_tokens
    fed_rows.clear()  # without prefix caching (a benchmark's repeats) each request starts cold
    monkeypatch.setattr(draft_model, "forward_segments", counting)
    fresh.generate(messages, max_new_tokens=24)
    assert fed_rows[0] == second.metrics.num_prompt_tokens + 1  # the prompt and the first token
