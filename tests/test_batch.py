"""Many prompts at once on the real SmolLM2-135M: Engine.generate_batch and `draftwise batch`
give each prompt what it gets alone (greedy: plain decoding's tokens; seeded coupled sampling:
the same draw), keep going past a failing prompt, and `draftwise batch` answers OpenAI batch
files in OpenAI's output format, resuming where an earlier run stopped."""

from __future__ import annotations

import json

import pytest

import draftwise
from draftwise import SamplingParams
from draftwise.batch import BatchError
from draftwise.cli import main
from draftwise.engine import Engine
from draftwise.errors import ConfigError, PromptError
from tests.conftest import PROMPTS


@pytest.fixture(scope="module")
def engine():
    """What `draftwise batch` and `generate` run by default: the file's blocks, ngram drafts."""
    return draftwise.load("smollm2-135m", drafter="ngram", progress=False)


@pytest.fixture(scope="module")
def plain(engine):
    return Engine(engine.target)


def test_generate_batch_greedy_equals_plain_decoding_of_each_prompt_alone(engine, plain):
    # Output limits of 12-36 tokens: sequences finish at different steps, so with 4 slots the
    # later prompts join a batch whose others are mid-answer.
    params = [SamplingParams(max_new_tokens=12 + 8 * (index % 4)) for index in range(len(PROMPTS))]
    finished = []  # on_result's calls: (index, result) as each prompt finishes
    results = engine.generate_batch(PROMPTS, params, max_batch=4, on_result=lambda *pair: finished.append(pair))
    assert len(results) == len(PROMPTS)
    assert sorted(index for index, _ in finished) == list(range(len(PROMPTS)))
    assert all(results[index] is result for index, result in finished)
    assert [index for index, _ in finished] != list(range(len(PROMPTS)))  # in the order they finished
    for prompt, each, result in zip(PROMPTS, params, results):
        assert result.token_ids == plain.generate(prompt, each).token_ids
        assert result.text and result.metrics.num_generated_tokens == len(result.token_ids)
    assert sum(result.metrics.num_accepted_tokens for result in results) > 0  # speculation ran


def test_generate_batch_seeded_coupled_sampling_equals_each_request_alone(engine):
    prompts = PROMPTS[:6]
    results = engine.generate_batch(prompts, max_batch=3, max_new_tokens=24, temperature=0.8, top_p=0.95, seed=7,
                                    sampling_mode="coupled")
    alone = [engine.generate(prompt, max_new_tokens=24, temperature=0.8, top_p=0.95, seed=7, sampling_mode="coupled")
             for prompt in prompts]
    assert [result.token_ids for result in results] == [result.token_ids for result in alone]
    assert len({tuple(result.token_ids) for result in results}) == len(prompts)  # six different answers


def test_generate_batch_refuses_bad_input_before_running_and_names_the_prompt(engine):
    with pytest.raises(PromptError, match="prompt 1 of the batch: the prompt is empty"):
        engine.generate_batch(["Hello", "   "], max_new_tokens=4)
    with pytest.raises(ConfigError, match="2 prompts but 3 SamplingParams"):
        engine.generate_batch(["a", "b"], [SamplingParams()] * 3)
    with pytest.raises(ConfigError, match="max_batch=0"):
        engine.generate_batch(["a"], max_batch=0)
    with pytest.raises(ConfigError, match="unknown sampling setting 'max_tokens'"):
        engine.generate_batch(["a"], max_tokens=4)
    assert engine.generate_batch([], max_new_tokens=4) == []


def test_a_prompt_that_fails_once_running_leaves_the_others_their_results(engine, plain):
    too_long = [1] * engine.target.model.info.max_context  # token ids: encoded, then refused by the context
    with pytest.raises(BatchError, match="prompt 1 of the batch failed") as raised:
        engine.generate_batch(["Shopping list:\n1. eggs\n2.", too_long, PROMPTS[2]], max_new_tokens=8, max_batch=2)
    error = raised.value
    assert set(error.errors) == {1} and isinstance(error.errors[1], PromptError) and "shorten the prompt" in str(error.errors[1])
    assert error.results[1] is None
    assert error.results[0].token_ids == plain.generate("Shopping list:\n1. eggs\n2.", max_new_tokens=8).token_ids
    assert error.results[2].token_ids == plain.generate(PROMPTS[2], max_new_tokens=8).token_ids


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_batch_command_answers_an_openai_batch_file_as_the_server_would_and_resumes(engine, plain, tmp_path, capsys):
    chat = [{"role": "user", "content": "List three prime numbers."}]
    requests = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "gpt-4o-mini", "messages": chat, "max_tokens": 24, "temperature": 0}},
        {"prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0},  # a bare body: line-2
        {"custom_id": "too-hot", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": chat, "temperature": 5}},
    ]
    source, answers = tmp_path / "requests.jsonl", tmp_path / "answers.jsonl"
    source.write_text("".join(json.dumps(request) + "\n" for request in requests))
    code = main(["batch", str(source), "--out", str(answers), "--quiet", "--max-batch", "2"])
    err = capsys.readouterr().err
    assert code == 0 and "3 requests: 2 answered, 1 refused (1 x 400" in err
    by_id = {line["custom_id"]: line for line in _lines(answers)}
    assert set(by_id) == {"chat", "line-2", "too-hot"}
    answer = by_id["chat"]["response"]
    assert answer["status_code"] == 200 and by_id["chat"]["error"] is None
    assert answer["body"]["object"] == "chat.completion" and answer["body"]["model"] == "smollm2-135m"
    assert answer["body"]["choices"][0]["message"]["content"] == plain.generate(chat, max_new_tokens=24).text
    assert answer["request_id"] == answer["body"]["id"]
    assert "speculative" in answer["body"]["usage"]
    completion = by_id["line-2"]["response"]["body"]
    assert completion["choices"][0]["text"] == plain.generate("def fibonacci(n):", max_new_tokens=16).text
    refused = by_id["too-hot"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "temperature"

    # A rerun after a kill that cut a line short: the answered are kept and skipped, the refused
    # one is tried again, the cut line dropped.
    with answers.open("a") as sink:
        sink.write('{"id": "batch_req_x", "custom_id": "line-2", "respo')
    code = main(["batch", str(source), "--out", str(answers), "--quiet", "--max-batch", "2"])
    err = capsys.readouterr().err
    assert code == 0 and "0 answered, 1 refused" in err and "2 already answered" in err
    lines = _lines(answers)
    assert sorted((line["custom_id"], line["response"]["status_code"]) for line in lines) == [
        ("chat", 200), ("line-2", 200), ("too-hot", 400)]


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "a"}\n{"prompt": 1\n', "line 2 is not JSON"),
    ('["a"]\n', "line 1 is a JSON list, not an object"),
    ('{"custom_id": "a", "body": {"prompt": "x"}, "url": "/v1/completions"}\n' * 2, "custom_id 'a' appears twice"),
    ('{"custom_id": "a", "body": {}, "url": "/v1/embeddings"}\n', "url '/v1/embeddings' is not served here"),
    ('{"body": {"prompt": "x"}, "url": "/v1/completions"}\n', 'needs a "custom_id" string'),
    ('{"text": "x"}\n', 'no "body", "messages" or "prompt"'),
    ("\n", "holds no requests"),
])
def test_batch_command_refuses_a_bad_file_before_loading_a_model(content, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("draftwise.cli._load_engine", lambda args: pytest.fail("the model loaded"))
    source = tmp_path / "requests.jsonl"
    source.write_text(content)
    code = main(["batch", str(source), "--out", str(tmp_path / "answers.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert main(["batch", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "a.jsonl")]) == 2
    assert main(["batch", str(source), "--out", str(source)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_batch_command_never_rewrites_an_output_that_is_not_its_own(tmp_path, capsys, monkeypatch):
    """--out naming someone's other file (not an earlier run's answers) or a missing folder is
    refused before the model loads, and the file is left as it was."""
    monkeypatch.setattr("draftwise.cli._load_engine", lambda args: pytest.fail("the model loaded"))
    source, precious = tmp_path / "requests.jsonl", tmp_path / "notes.jsonl"
    source.write_text('{"prompt": "a"}\n')
    precious.write_text('{"note": "keep me"}\n{"note": "and me"}\n')
    assert main(["batch", str(source), "--out", str(precious)]) == 2
    assert "already holds something other than batch answers (line 1)" in capsys.readouterr().err
    assert precious.read_text() == '{"note": "keep me"}\n{"note": "and me"}\n'
    assert main(["batch", str(source), "--out", str(tmp_path / "missing" / "answers.jsonl")]) == 2
    assert "does not exist; create it first" in capsys.readouterr().err
