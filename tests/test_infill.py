"""Fill-in-the-middle on the real Qwen2.5-Coder-0.5B (trained for it), and stop_token_ids."""

from __future__ import annotations

import openai
import pytest

import draftwise
from draftwise import SamplingParams
from draftwise.engine import Engine
from draftwise.errors import PromptError
from draftwise.infill import infill_prompt
from draftwise.server import ServerThread

PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(2, 3))\n"


@pytest.fixture(scope="module")
def coder(qwen_tokenizer):  # (the tokenizer's fixture fetches the model on a fresh machine)
    return draftwise.load("qwen2.5-coder-0.5b", drafter="ngram", progress=False)


def test_the_infill_prompt_is_prefix_suffix_middle_and_ends_at_end_of_text(coder, smollm2_tokenizer):
    tokenizer = coder.tokenizer
    ids, stops = infill_prompt(tokenizer, PREFIX, SUFFIX)
    vocabulary = tokenizer.get_vocab()
    assert ids[0] == vocabulary["<|fim_prefix|>"] and ids[-1] == vocabulary["<|fim_middle|>"]
    cut = ids.index(vocabulary["<|fim_suffix|>"])
    assert tokenizer.decode(ids[1:cut]) == PREFIX and tokenizer.decode(ids[cut + 1:-1]) == SUFFIX
    assert {vocabulary["<|endoftext|>"], vocabulary["<|fim_pad|>"]} <= set(stops)
    with pytest.raises(PromptError, match="fill-in-the-middle"):
        infill_prompt(smollm2_tokenizer, PREFIX, SUFFIX)  # SmolLM2's vocabulary has no such tokens


def test_a_middle_stops_at_its_end_token_and_speculation_gives_plain_decodings(coder):
    ids, stops = infill_prompt(coder.tokenizer, PREFIX, SUFFIX)
    params = SamplingParams(max_new_tokens=40, stop_token_ids=stops)
    result = coder.generate(ids, params)
    assert "return a + b" in result.text  # what a code model writes between these two
    assert result.finish_reason == "stop" and not set(result.token_ids) & set(stops)
    assert result.token_ids == Engine(coder.target).generate(ids, params).token_ids
    # Without the end tokens the same middle runs on past them (the chat model's EOS is another).
    longer = coder.generate(ids, max_new_tokens=40)
    assert longer.token_ids[:len(result.token_ids)] == result.token_ids and len(longer.token_ids) > len(result.token_ids)


def test_the_servers_suffix_and_stop_token_ids(coder):
    ids, stops = infill_prompt(coder.tokenizer, PREFIX, SUFFIX)
    expected = Engine(coder.target).generate(ids, SamplingParams(max_new_tokens=40, stop_token_ids=stops))
    with ServerThread(coder, max_batch=2) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=120)
        completion = client.completions.create(model=coder.target.model.info.name, prompt=PREFIX, suffix=SUFFIX,
                                               max_tokens=40, temperature=0)
        assert completion.choices[0].text == expected.text and completion.choices[0].finish_reason == "stop"
        # stop_token_ids (an extension, as vLLM's): the output ends before the first of them.
        stop_at = expected.token_ids[3]
        cut = client.completions.create(model=coder.target.model.info.name, prompt=PREFIX, suffix=SUFFIX, max_tokens=40,
                                        temperature=0, extra_body={"stop_token_ids": [stop_at]})
        assert cut.usage.completion_tokens == expected.token_ids.index(stop_at)
        with pytest.raises(openai.BadRequestError, match="suffix"):
            client.completions.create(model=coder.target.model.info.name, prompt=PREFIX, suffix=SUFFIX, echo=True,
                                      max_tokens=4)
