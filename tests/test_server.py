"""`draftwise serve` on the real SmolLM2-135M (its shipped GGUF blocks, as `draftwise generate`
runs it), on a loopback port: the official openai client, many concurrent streams, a client
that disconnects, bad input, a schema fuzz and a bounded load test."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, settings

import draftwise
from draftwise import SamplingParams
from draftwise.engine import Engine
from draftwise.server import ServerSettings, ServerThread
from tests.conftest import PROMPTS

API_KEY = "test-key"
LOAD_TEST_SECONDS = float(os.environ.get("DRAFTWISE_LOAD_TEST_SECONDS", "12"))


@pytest.fixture(scope="module")
def engine():
    return draftwise.load("smollm2-135m", drafter="ngram", progress=False)


@pytest.fixture(scope="module")
def plain(engine):
    """Plain greedy decoding on the same weights: the reference every greedy answer must equal."""
    return Engine(engine.target)


class ServedProcess:
    """`draftwise serve` as users run it: its own process, the model on its main thread."""

    def __init__(self, *flags: str) -> None:
        import socket
        import tempfile

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="draftwise-serve-", suffix=".log")
        self.process = subprocess.Popen([sys.executable, "-m", "draftwise.cli", "serve", "--port", str(port), "--quiet",
                                         *flags], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            assert self.process.poll() is None, f"draftwise serve exited: {open(self.log.name).read()[-3000:]}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "draftwise serve did not start in 300 s"
            time.sleep(0.3)

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def server():
    # --draft-length fixed: every ngram draft is verified (up to 4 tokens: a short verify, cheap on
    # any CPU), so the tests below that check what speculation returned (logprobs, accepted
    # tokens) do not depend on this machine's timings.
    # Adaptive, on a loaded 2-core AMD EPYC Zen 3 in CI (two test workers beside the server), the
    # policy measured verifies too dear to draft at all and the logprobs test saw 0 accepted tokens.
    served = ServedProcess("--api-key", API_KEY, "--max-batch", "16", "--max-body-bytes", "200000",
                           "--draft-length", "fixed", "--num-draft-tokens", "4")
    yield served
    served.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_openai_client_chat_and_completions_equal_draftwise_generate(server, client, plain):
    prompt = "List three uses of a paperclip."
    cli = subprocess.run([sys.executable, "-m", "draftwise.cli", "generate", prompt, "--chat", "--max-new-tokens", "40",
                          "--json", "--quiet"], capture_output=True, text=True, timeout=300, check=True)
    expected = json.loads(cli.stdout)["text"]
    messages = [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=40, temperature=0)
    assert chat.choices[0].message.content == expected
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens > 0
    speculative = chat.usage.model_extra["speculative"]
    assert speculative["draft_tokens"] >= speculative["accepted_tokens"] >= 0
    assert speculative["mean_accepted_length"] >= 1.0

    chunks = list(client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=40, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.model_extra["speculative"]["target_forwards"] > 0

    text_prompt = PROMPTS[2]
    reference = plain.generate(text_prompt, SamplingParams(max_new_tokens=32)).text
    completion = client.completions.create(model="smollm2-135m", prompt=text_prompt, max_tokens=32, temperature=0)
    assert completion.choices[0].text == reference
    stream = client.completions.create(model="smollm2-135m", prompt=text_prompt, max_tokens=32, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == reference
    models = list(client.models.list())
    assert [m.id for m in models] == ["smollm2-135m"]
    assert 0 < time.time() - models[0].created < 3600  # when the server took the model up, not 1970


def test_a_chats_next_turn_reuses_its_prefix_and_says_so_in_usage(server, client, plain):
    """`draftwise serve` keeps finished requests' keys and values (--prefix-cache-mb, on by
    default): the second turn prefills only its new question, with the same answer."""
    messages = [{"role": "user", "content": "Explain what a hash map is, briefly."}]
    first = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And a list?"}]
    second = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24, temperature=0)
    assert second.choices[0].message.content == plain.generate(messages, SamplingParams(max_new_tokens=24)).text
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    assert _metric(server, "draftwise_cached_prompt_tokens_total") >= cached
    assert 0 < _metric(server, "draftwise_prefix_cache_bytes") <= 512 << 20


def test_logprobs_through_the_openai_client_are_plain_decodings_whole_or_streamed(server, client, plain):
    """Chat's logprobs + top_logprobs and completions' logprobs: OpenAI's shapes, the same floats as
    plain decoding of the same prompt (the server speculates with ngram), their bytes the text."""
    messages = [PROMPTS[1][0]]  # a code edit: ngram's drafts get accepted
    expected = plain.generate(messages, SamplingParams(max_new_tokens=40, logprobs=3))
    chat = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=40, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert [(item.logprob, [top.logprob for top in item.top_logprobs]) for item in content] == \
        [(entry.logprob, [logprob for _, logprob in entry.top]) for entry in expected.logprobs]
    assert bytes(b for item in content for b in item.bytes).decode() == chat.choices[0].message.content
    assert all(item.top_logprobs[0].token == item.token for item in content)  # greedy: the top token
    assert chat.usage.model_extra["speculative"]["accepted_tokens"] > 0

    chunks = list(client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=40, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    assert [item.model_dump() for item in streamed] == [item.model_dump() for item in content]
    plain_chat = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=4, temperature=0)
    assert plain_chat.choices[0].logprobs is None  # not asked: none

    prompt = PROMPTS[2]
    expected = plain.generate(prompt, SamplingParams(max_new_tokens=24, logprobs=2))
    completion = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=24, temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert logprobs.token_logprobs == [entry.logprob for entry in expected.logprobs]
    assert "".join(logprobs.tokens) == completion.choices[0].text  # ASCII code: each token's text is whole
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    assert all(top[token] == logprob and len(top) in (2, 3)
               for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs))
    chunks = list(client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=24, temperature=0,
                                            logprobs=2, stream=True))
    pieces = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(pieces) > 1
    assert [value for piece in pieces for value in piece.token_logprobs] == logprobs.token_logprobs
    assert [value for piece in pieces for value in piece.text_offset] == logprobs.text_offset


def test_penalties_through_the_openai_client_equal_plain_decoding_with_them(server, client, plain):
    """logit_bias, presence / frequency penalties (OpenAI's) and repetition_penalty (an extension, as vLLM's):
    the answer is plain greedy decoding with the same penalties, though the server speculates."""
    messages = [PROMPTS[1][0]]
    banned = plain.generate(messages, SamplingParams(max_new_tokens=1)).token_ids[0]  # plain's first token
    reply = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=40, temperature=0,
                                           frequency_penalty=0.8, presence_penalty=0.4, logit_bias={str(banned): -100},
                                           extra_body={"repetition_penalty": 1.2})
    params = SamplingParams(max_new_tokens=40, frequency_penalty=0.8, presence_penalty=0.4, repetition_penalty=1.2,
                            logit_bias={banned: -100.0})
    expected = plain.generate(messages, params).text
    assert reply.choices[0].message.content == expected
    assert expected != plain.generate(messages, SamplingParams(max_new_tokens=40)).text
    # min_tokens and ignore_eos (extensions, as vLLM's): a short answer runs to max_tokens.
    hi = [{"role": "user", "content": "Say hi."}]
    assert client.chat.completions.create(model="smollm2-135m", messages=hi, max_tokens=48,
                                          temperature=0).usage.completion_tokens < 40
    for extra in ({"ignore_eos": True}, {"min_tokens": 48}):
        forced = client.chat.completions.create(model="smollm2-135m", messages=hi, max_tokens=48, temperature=0,
                                                extra_body=extra)
        assert forced.usage.completion_tokens == 48 and forced.choices[0].finish_reason == "length", extra
    with pytest.raises(openai.BadRequestError, match="min_new_tokens"):
        client.chat.completions.create(model="smollm2-135m", messages=hi, max_tokens=4, extra_body={"min_tokens": 5})


def test_response_format_json_through_the_openai_client_is_plain_decoding_under_the_grammar(server, client, plain):
    """json_schema and json_object (OpenAI's response_format): the reply is JSON the schema allows,
    and the same text as plain greedy decoding under the same grammar, though the server speculates."""
    from draftwise import structured

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "city": {"type": "string"}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Describe a fictional person as JSON with name, age and city."}]
    reply = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=80, temperature=0,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "person", "schema": schema}})
    person = json.loads(reply.choices[0].message.content)
    assert set(person) == {"name", "age", "city"} and isinstance(person["age"], int)
    expected = plain.generate(messages, SamplingParams(max_new_tokens=80, grammar=structured.json_schema(schema)))
    assert reply.choices[0].message.content == expected.text
    free = plain.generate(messages, SamplingParams(max_new_tokens=80)).text
    assert free != expected.text  # the grammar changed the answer (the free one starts with prose)
    anything = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=80, temperature=0,
                                              response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_echo_scores_the_prompt_as_evaluation_harnesses_ask(server, client, plain):
    """What lm-evaluation-harness's completions model sends for a log-likelihood (prompt as token
    ids or text, echo, logprobs=1, max_tokens 1 or 0): the prompt's tokens' logprobs (null for the
    first), the same numbers as scoring it in Python, then the generated token's."""
    text = "Question: What is the capital of France?\nAnswer: Paris"
    ids = plain.encode(text)
    scored = plain.generate(ids, SamplingParams(max_new_tokens=1, logprobs=1, prompt_logprobs=1))
    for prompt in (ids, text):
        completion = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=1, temperature=0,
                                               echo=True, logprobs=1)
        choice = completion.choices[0]
        assert choice.text == text + scored.text
        logprobs = choice.logprobs
        assert logprobs.token_logprobs == [None] + [e.logprob for e in scored.prompt_logprobs[1:]] + \
            [scored.logprobs[0].logprob]
        assert logprobs.top_logprobs[0] is None and "".join(logprobs.tokens) == choice.text
        assert logprobs.text_offset[-1] == len(text)  # the generated token starts where the prompt ends
        assert completion.usage.prompt_tokens == len(ids) and completion.usage.completion_tokens == 1
    only = client.completions.create(model="smollm2-135m", prompt=text, max_tokens=0, echo=True, logprobs=0)
    assert only.choices[0].text == text and only.usage.completion_tokens == 0
    assert only.choices[0].logprobs.token_logprobs == logprobs.token_logprobs[:-1]
    chunks = list(client.completions.create(model="smollm2-135m", prompt=text, max_tokens=4, temperature=0, echo=True,
                                            logprobs=1, stream=True))
    assert chunks[0].choices[0].text == text
    streamed = [value for c in chunks if c.choices and c.choices[0].logprobs for value in c.choices[0].logprobs.token_logprobs]
    assert streamed[:len(ids)] == logprobs.token_logprobs[:-1] and len(streamed) == len(ids) + 4

    headers = {"Authorization": f"Bearer {API_KEY}"}
    for body, words in [({"prompt": text, "max_tokens": 0}, "max_tokens=0 generates nothing"),
                        ({"prompt": [5, 10**7], "max_tokens": 2}, "outside"),
                        ({"prompt": [[1, 2], [3]], "max_tokens": 2}, "one prompt per request")]:
        response = httpx.post(server.url + "/v1/completions", headers=headers, timeout=60, json=body)
        assert response.status_code == 400 and words in response.json()["error"]["message"], response.text


def _jobs():
    """16 requests: all twelve prompts plus four, with different output lengths."""
    return [(PROMPTS[i % len(PROMPTS)], 12 + 6 * (i % 5)) for i in range(16)]


def _stream(client, prompt, max_tokens, **sampling) -> str:
    kwargs = dict(model="smollm2-135m", max_tokens=max_tokens, stream=True, **sampling)
    if isinstance(prompt, str):
        return "".join(c.choices[0].text for c in client.completions.create(prompt=prompt, **kwargs) if c.choices)
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(messages=prompt, **kwargs)
                   if c.choices)


def _concurrently(function, jobs) -> list:
    results, errors = [None] * len(jobs), []

    def run(index, job):
        try:
            results[index] = function(*job)
        except Exception as error:  # collected and reported below, with the request
            errors.append((index, error))

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors, errors
    return results


def test_16_concurrent_greedy_streams_equal_their_sequential_outputs(server, client, plain):
    jobs = _jobs()
    expected = [plain.generate(prompt, SamplingParams(max_new_tokens=n)).text for prompt, n in jobs]
    served_before = _metric(server, "draftwise_generated_tokens_total")
    got = _concurrently(lambda prompt, n: _stream(client, prompt, n, temperature=0), jobs)
    assert got == expected
    assert _metric(server, "draftwise_generated_tokens_total") > served_before
    assert _metric(server, "draftwise_batch_size") == 0  # every slot freed


def test_16_concurrent_seeded_streams_equal_the_same_requests_served_alone(server, client, plain):
    jobs = [(prompt, n // 2, 1000 + i) for i, (prompt, n) in enumerate(_jobs())]

    def sample(prompt, n, seed):
        return _stream(client, prompt, n, temperature=0.8, top_p=0.95, seed=seed,
                       extra_body={"sampling_mode": "coupled"})

    alone = [sample(*job) for job in jobs]
    together = _concurrently(sample, jobs)
    assert together == alone
    assert len(set(alone)) > 1
    # The same seed gives the same text from the Python API (default mode, no drafter) as from
    # the server (its drafter, its batch).
    assert alone[:3] == [plain.generate(prompt, SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_new_tokens=n)).text
                         for prompt, n, seed in jobs[:3]]


def test_a_client_that_disconnects_frees_its_slot_and_others_keep_streaming(server, client, plain):
    cancelled_before = _metric(server, "draftwise_cancelled_requests_total")
    body = {"model": "smollm2-135m", "messages": PROMPTS[0], "max_tokens": 2000, "temperature": 0, "stream": True}
    other = threading.Thread(target=lambda: results.append(_stream(client, PROMPTS[7], 48, temperature=0)))
    results: list[str] = []
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            other.start()
            lines = response.iter_lines()
            for _ in range(6):
                next(lines)
        # Leaving the block closes the connection mid-stream.
    other.join(timeout=300)
    assert results == [plain.generate(PROMPTS[7], SamplingParams(max_new_tokens=48)).text]
    deadline = time.monotonic() + 30
    while _metric(server, "draftwise_cancelled_requests_total") <= cancelled_before or _metric(server, "draftwise_batch_size"):
        assert time.monotonic() < deadline, "the disconnected request kept its slot"
        time.sleep(0.2)


LONG_PROMPT = "hello " * 9000  # > SmolLM2's 8192-token context, < the 200 kB body limit

BAD_INPUTS = [
    # (name, raw body or JSON, headers, status, words the message must contain)
    ("malformed JSON", b'{"messages": [', {}, 400, "not valid JSON"),
    ("wrong type", {"messages": "hi"}, {}, 400, "messages"),
    ("wrong type of max_tokens", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, {}, 400, "max_tokens"),
    ("negative max_tokens", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, {}, 400, "max_tokens"),
    ("huge max_tokens", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, {}, 400, "8192"),
    ("temperature < 0", {"messages": [{"role": "user", "content": "hi"}], "temperature": -0.5}, {}, 400, "temperature"),
    ("top_p > 1", {"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, {}, 400, "top_p"),
    ("top_p = 0", {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, {}, 400, "top_p"),
    ("n > 1", {"messages": [{"role": "user", "content": "hi"}], "n": 3}, {}, 400, "n > 1"),
    ("empty messages", {"messages": []}, {}, 400, "messages"),
    ("blank messages", {"messages": [{"role": "user", "content": "   "}]}, {}, 400, "content"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, {}, 400, "role"),
    ("oversize body", {"messages": [{"role": "user", "content": "x" * 300_000}]}, {}, 413, "200000"),
    ("prompt beyond the context", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, {}, 400, "8192"),
    ("wrong API key", {"messages": [{"role": "user", "content": "hi"}]}, {"Authorization": "Bearer nope"}, 401, "API key"),
    ("no API key", {"messages": [{"role": "user", "content": "hi"}]}, {"Authorization": ""}, 401, "API key"),
    ("wrong model", {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, {}, 404, "gpt-4o"),
    ("bad speculative", {"messages": [{"role": "user", "content": "hi"}], "speculative": {"num_draft_tokens": -1}}, {},
     400, "num_draft_tokens"),
    ("top_logprobs > 20", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, {},
     400, "top_logprobs"),
    ("top_logprobs without logprobs", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, {}, 400,
     "top_logprobs needs logprobs: true"),
    # fields that would change the answer, not implemented: refused by name, never ignored
    ("frequency_penalty > 2", {"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 2.5}, {}, 400,
     "frequency_penalty"),
    ("repetition_penalty 0", {"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 0}, {}, 400,
     "repetition_penalty"),
    ("logit_bias key", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"hello": 5}}, {}, 400,
     "not a token id"),
    ("logit_bias beyond the vocabulary", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"999999": 5}},
     {}, 400, "outside"),
    ("logit_bias > 100", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"42": 101}}, {}, 400,
     "[-100, 100]"),
    ("response_format type", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
     {}, 400, "response_format.type"),
    ("a schema that cannot compile", {"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}},
     {}, 400, "JSON schema cannot be compiled"),
    ("tools without a function", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     {}, 400, "tools.0.function"),
    ("tools the model's template cannot show", {"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "get_time"}}]}, {}, 400, "has no place for tools"),
    # a seed the random generator cannot take: once a 500-less hang (it killed the batch loop)
    ("seed beyond 64 bits", {"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, {}, 400, "seed"),
]


@pytest.mark.parametrize("name, body, headers, status, words", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_gets_a_clear_4xx_in_openai_format(server, name, body, headers, status, words):
    sent = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", **headers}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.url + "/v1/chat/completions", content=content, headers=sent, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"]


def test_unimplemented_fields_at_their_neutral_values_are_accepted(server):
    """Clients that send OpenAI's defaults explicitly (penalties 0, text format, no bias) are served;
    only values that would change the answer are refused (above), and best_of > 1 on completions."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"},
               "tools": [], "top_logprobs": 0, "max_tokens": 3, "temperature": 0}
    response = httpx.post(server.url + "/v1/chat/completions", headers=headers, timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}], **neutral})
    assert response.status_code == 200, response.text
    response = httpx.post(server.url + "/v1/completions", headers=headers, timeout=60,
                          json={"prompt": "Once", "best_of": 1, "suffix": "", **neutral})
    assert response.status_code == 200, response.text
    response = httpx.post(server.url + "/v1/completions", headers=headers, timeout=60,
                          json={"prompt": "Once", "best_of": 2, "max_tokens": 3})
    assert response.status_code == 400 and "best_of is not supported" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "best_of"
    response = httpx.post(server.url + "/v1/completions", headers=headers, timeout=60,
                          json={"prompt": "Once", "tools": [{"type": "function"}], "max_tokens": 3})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
    assert "/v1/chat/completions" in response.json()["error"]["message"]
    response = httpx.post(server.url + "/v1/completions", headers=headers, timeout=60,
                          json={"prompt": "def f(", "suffix": "    return x\n", "max_tokens": 3})
    assert response.status_code == 400 and "fill-in-the-middle" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "suffix"  # SmolLM2 was not trained for it


def test_a_completion_prompt_beyond_the_context_names_both_numbers(server):
    response = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                          json={"prompt": "one two three", "max_tokens": 8190})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "8190" in message and "8192" in message and "prompt (" in message


def test_a_completion_prompt_the_tokenizer_drops_entirely_gets_a_400(server):
    # CI's schemathesis run sent {"prompt": "\x16"}: SmolLM2's tokenizer gives no tokens for it,
    # and the empty prefill failed inside the forward (503).
    response = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                          json={"prompt": "\x16", "max_tokens": 4})
    assert response.status_code == 400, response.text
    assert "no tokens" in response.json()["error"]["message"]


def test_a_base_model_answers_chat_with_a_400_naming_completions_and_serves_completions(gemma):
    """Gemma 3 270M has no chat template: a chat request is a 400 that says where to send the text,
    and /v1/completions serves it (the greedy text draftwise generate gives)."""
    engine = Engine(gemma)
    with ServerThread(engine, max_batch=2) as live:
        chat = httpx.post(live.url + "/v1/chat/completions", timeout=120,
                          json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
        assert chat.status_code == 400
        assert "/v1/completions" in chat.json()["error"]["message"] and chat.json()["error"]["param"] == "messages"
        text = httpx.post(live.url + "/v1/completions", timeout=120,
                          json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        assert text.status_code == 200
        assert text.json()["choices"][0]["text"] == engine.generate("The capital of France is", max_new_tokens=8).text


def test_the_queue_limit_answers_429_with_retry_after(engine):
    with ServerThread(engine, max_batch=1, max_queue=1) as small:
        body = {"prompt": "Count to one hundred:", "max_tokens": 64, "temperature": 0}
        statuses: list[httpx.Response] = []

        def post():
            statuses.append(httpx.post(small.url + "/v1/completions", json=body, timeout=120))

        threads = [threading.Thread(target=post) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    codes = sorted(r.status_code for r in statuses)
    assert codes.count(200) >= 2 and codes.count(429) >= 1 and set(codes) <= {200, 429}
    refused = next(r for r in statuses if r.status_code == 429)
    assert int(refused.headers["Retry-After"]) >= 1 and refused.json()["error"]["code"] == "queue_full"


@pytest.fixture(scope="module")
def fuzz_server(engine):
    """Output capped at 16 tokens (asking for more is a 400), so the fuzz spends its time on
    many requests rather than on a few long generations."""
    settings = ServerSettings(api_key=API_KEY, max_body_bytes=200_000, default_max_tokens=16, max_tokens_limit=16)
    with ServerThread(engine, max_batch=8, settings=settings) as live:
        yield live


@pytest.fixture(scope="module")
def served_schema(fuzz_server):
    import schemathesis

    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


def _fuzz_schema():
    import schemathesis

    return schemathesis.pytest.from_fixture("served_schema")


fuzz_schema = _fuzz_schema()


@fuzz_schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzzing_the_served_openapi_schema_finds_no_server_error(case, fuzz_server):
    """Property-based requests generated from GET /openapi.json (valid and invalid bodies,
    every route): never a 5xx, and every 4xx in OpenAI's error format."""
    response = case.call(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    assert response.status_code < 500, (case.body, response.text)
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def test_load_32_clients_no_errors_bounded_memory_and_429_beyond_the_queue(engine):
    """32 clients, each sending request after request (chat and text, streamed and not, greedy
    and seeded sampling) for DRAFTWISE_LOAD_TEST_SECONDS (12 s here; the README's run used 120)
    against a server with 8 batch slots and 8 queue places: no 5xx, no transport error,
    429s beyond the queue, memory flat after warm-up."""
    import random

    counts = {"ok": 0, "429": 0, "errors": []}
    lock = threading.Lock()
    with ServerThread(engine, max_batch=8, max_queue=8) as live:
        deadline = time.monotonic() + LOAD_TEST_SECONDS
        rss: list[float] = []

        def client_loop(index: int) -> None:
            rng = random.Random(index)
            with httpx.Client(base_url=live.url, timeout=120) as http:
                while time.monotonic() < deadline:
                    prompt = rng.choice(PROMPTS)
                    body = {"max_tokens": rng.randint(4, 40), "temperature": rng.choice([0, 0.7]), "seed": rng.randint(0, 99),
                            "stream": rng.random() < 0.5}
                    path = "/v1/completions" if isinstance(prompt, str) else "/v1/chat/completions"
                    body["prompt" if isinstance(prompt, str) else "messages"] = prompt
                    try:
                        response = http.post(path, json=body)
                        text = response.text
                    except httpx.HTTPError as error:
                        with lock:
                            counts["errors"].append(repr(error))
                        continue
                    with lock:
                        if response.status_code == 200 and (not body["stream"] or text.endswith("data: [DONE]\n\n")):
                            counts["ok"] += 1
                        elif response.status_code == 429:
                            counts["429"] += 1
                        else:
                            counts["errors"].append((response.status_code, text[:200]))
                    if response.status_code == 429:
                        time.sleep(float(response.headers["Retry-After"]) * rng.random())

        def watch_memory() -> None:
            while time.monotonic() < deadline:
                rss.append(_rss_mb())
                time.sleep(1)

        threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(32)]
        threads.append(threading.Thread(target=watch_memory))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=LOAD_TEST_SECONDS + 300)
        assert _metric(live, "draftwise_batch_size") == 0
    print(f"load: {LOAD_TEST_SECONDS:g} s, {counts['ok']} answered, {counts['429']} x 429, {len(counts['errors'])} errors, "
          f"RSS {rss[0]:.0f} -> {max(rss):.0f} MB")  # shown with pytest -s
    assert counts["errors"] == []
    # Answers kept coming while most tries met a full queue: at least two full batches' worth (one
    # thread per test process under pytest-xdist, the other process busy: 29 in 12 s measured on 2
    # Zen 3 cores, so 32 was a coin toss there).
    assert counts["ok"] >= 16 and counts["429"] > 0
    warm = rss[len(rss) // 4:]
    assert max(warm) - warm[0] < 300, f"memory grew from {warm[0]:.0f} MB to {max(warm):.0f} MB under steady load"
