"""`draftwise bench`: the task suite, the summary arithmetic, and a small real run end to end."""

from __future__ import annotations

import json

import pytest

from draftwise.bench.report import summarize, write_report
from draftwise.bench.runner import BenchConfig, build_methods, run_bench
from draftwise.bench.suite import default_prompt_dir, load_suite
from draftwise.errors import ConfigError

CATEGORIES = {"chat", "code_edit", "summarization", "translation", "rag_qa", "math"}


def test_suite_has_six_categories_of_eight_prompts():
    prompts = load_suite(default_prompt_dir())
    assert {p.category for p in prompts} == CATEGORIES
    for category in CATEGORIES:
        assert sum(p.category == category for p in prompts) >= 8
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.messages[-1]["role"] == "user" for p in prompts)


def test_suite_filters_by_category_and_count():
    prompts = load_suite(default_prompt_dir(), categories=["math", "chat"], per_category=2)
    assert sorted(p.category for p in prompts) == ["chat", "chat", "math", "math"]


def test_malformed_prompt_file_names_file_and_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"id": "x", "category": "chat", "messages": []}\n{"id": "y"}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:2"):
        load_suite(tmp_path)


def stats(committed: int, forwards: int, drafted: int, accepted: int, proposed_pp, accepted_pp) -> dict:
    return {"num_committed_tokens": committed, "num_target_forwards": forwards, "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted, "proposed_per_position": proposed_pp,
            "accepted_per_position": accepted_pp, "draft_s": 0.1, "verify_s": 0.8, "prefill_s": 0.1,
            "overhead_s": 0.0, "target_forward_s": 0.7, "total_s": 1.0}


def test_summary_speedups_are_throughput_ratios_within_a_category():
    rows = [
        {"category": "c", "method": "draftwise plain", "num_tokens": 10, "seconds": 2.0, "reference": None,
         "same_as_reference": None, "metrics": stats(10, 10, 0, 0, [], [])},
        {"category": "c", "method": "draftwise ngram k=2", "num_tokens": 10, "seconds": 1.0, "reference": "draftwise plain",
         "same_as_reference": False, "metrics": stats(10, 4, 8, 6, [4, 4], [4, 2])},
        {"category": "c", "method": "transformers plain", "num_tokens": 10, "seconds": 4.0, "reference": "draftwise plain",
         "same_as_reference": True, "metrics": None},
    ]
    by_method = {e["method"]: e for e in summarize(rows) if e["category"] == "c"}
    ngram = by_method["draftwise ngram k=2"]
    assert ngram["speedup_vs_draftwise_plain"] == pytest.approx(2.0)
    assert ngram["speedup_vs_transformers_plain"] == pytest.approx(4.0)
    assert ngram["mean_accepted_length"] == pytest.approx(2.5)
    assert ngram["acceptance_rate"] == pytest.approx(0.75)
    assert ngram["per_position_acceptance"] == pytest.approx([1.0, 0.5])
    assert ngram["num_mismatches"] == 1
    assert ngram["overhead_vs_forward"] == pytest.approx(0.1 / 0.7)  # the verifier's 0.1 s outside the forwards
    assert "mean_accepted_length" not in by_method["transformers plain"]


def test_small_real_run_matches_plain_greedy_and_writes_reports(smollm2, tmp_path):
    # transformers' rows: test_cli.py's `bench --quick` runs and checks them (they cost half this run).
    config = BenchConfig(max_new_tokens=16, repeats=1, with_llama_cpp=False, with_transformers=False)
    methods, skipped = build_methods(config, progress=False)
    names = [m.name for m in methods]
    assert names[:2] == ["draftwise plain", "draftwise ngram k<=10 adaptive"]
    assert not any(name.startswith("transformers") for name in names)
    assert any("model" in note and "--draft-model" in note for note in skipped)
    prompts = load_suite(default_prompt_dir(), categories=["code_edit", "chat"], per_category=1)
    rows = run_bench(methods, prompts, config.max_new_tokens, config.repeats, progress=False)
    assert len(rows) == len(prompts) * len(methods)
    # float32: every lossless method reproduces plain greedy decoding, token for token.
    checked = [row for row in rows if row["method"] != "draftwise plain"]
    assert all(row["reference"] == "draftwise plain" for row in checked)
    assert all(row["same_as_reference"] for row in checked), [(r["method"], r["prompt"]) for r in checked
                                                              if not r["same_as_reference"]]
    assert all(row["tokens_per_second"] > 0 for row in rows)
    paths = write_report(tmp_path, {"model": "smollm2-135m", "draft_model": None, "dtype": "float32",
                                    "max_new_tokens": 16, "repeats": 1, "threads": 2}, rows, skipped)
    assert {p.name for p in paths} == {"bench.json", "bench.md", "speedup.png", "acceptance.png"}
    assert all(p.stat().st_size > 0 for p in paths)
    assert json.loads((tmp_path / "bench.json").read_text())["summary"]
    assert "| all | draftwise ngram k<=10 adaptive |" in (tmp_path / "bench.md").read_text()


def test_a_base_model_without_a_chat_template_is_benched_on_the_prompts_text(gemma, tmp_path):
    """Gemma 3 270M has no chat template: the suite's prompts go in as plain text (each message's
    content, blank lines between them) instead of failing on the first prompt, and the report says so."""
    config = BenchConfig(model="gemma3-270m", activations="float32", max_new_tokens=12, repeats=1,
                         with_llama_cpp=False, with_transformers=False, drafters=("none", "ngram"))
    methods, _ = build_methods(config, progress=False)
    prompts = load_suite(default_prompt_dir(), categories=["code_edit"], per_category=1)
    assert prompts[0].as_text() == "\n\n".join(m["content"] for m in prompts[0].messages)
    rows = run_bench(methods, prompts, config.max_new_tokens, config.repeats, progress=False, chat=False)
    assert [row["method"] for row in rows] == ["draftwise plain", "draftwise ngram k<=10 adaptive"]
    assert rows[1]["same_as_reference"] and rows[0]["tokens_per_second"] > 0
    write_report(tmp_path, {"model": "gemma3-270m", "draft_model": None, "dtype": "auto", "max_new_tokens": 12,
                            "repeats": 1, "threads": 2, "prompts_as": "plain text"}, rows, [])
    assert "prompts as plain text (no chat template)" in (tmp_path / "bench.md").read_text()


def test_quantized_rows_are_checked_against_their_own_plain_decoding(smollm2):
    config = BenchConfig(max_new_tokens=16, repeats=1, quantize=("int4",), activation_rows=("int8",),
                         with_transformers=False, with_llama_cpp=False)
    methods, _ = build_methods(config, progress=False)
    references = {m.name: m.reference for m in methods}
    assert references["draftwise int4 plain"] is None
    assert references["draftwise int4 ngram k<=10 adaptive"] == "draftwise int4 plain"
    assert references["draftwise int8-act ngram k<=10 adaptive"] == "draftwise int8-act plain"
    int8_plain = next(m for m in methods if m.name == "draftwise int8-act plain")
    assert int8_plain.engine.target.model.lm_head.weight.activations == "int8"  # the rows really run int8
    assert references["draftwise ngram k<=10 adaptive"] == "draftwise plain"


def test_llama_cpp_is_skipped_with_the_install_command_when_missing(smollm2, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` fail
    config = BenchConfig(max_new_tokens=16, repeats=1, with_transformers=False)
    methods, skipped = build_methods(config, progress=False)
    assert not any(m.name.startswith("llama.cpp") for m in methods)
    assert any(note.startswith("llama.cpp:") and "pip install llama-cpp-python" in note for note in skipped)


class _PrefixCachingLlama:
    """llama_cpp.Llama's prompt reuse, reduced: generate() evaluates only the part of the prompt
    past the longest prefix it shares with what it evaluated last, unless reset() ran."""

    def __init__(self) -> None:
        self.evaluated: list[int] = []
        self.prefilled: list[int] = []  # prompt tokens each generate() call evaluated

    def reset(self) -> None:
        self.evaluated = []

    def generate(self, tokens, **_):
        shared = 0
        for a, b in zip(self.evaluated, tokens):
            if a != b:
                break
            shared += 1
        self.prefilled.append(len(tokens) - shared)
        self.evaluated = list(tokens)
        for step in range(100):
            self.evaluated.append(7)
            yield 7


def test_llama_cpp_rows_prefill_every_prompt_whole():
    """draftwise keeps no prompt cache, so llama.cpp's rows must not reuse the last prompt's keys
    and values (the warm-up's run of the first prompt, the chat template's shared system prompt):
    each run prefills its whole prompt."""
    from draftwise.bench.methods import LlamaCppMethod

    llm = _PrefixCachingLlama()
    method = LlamaCppMethod("llama.cpp plain", llm, lambda messages: [1, 2, 3] + [len(m["content"]) for m in messages],
                            (0,), None)
    first, second = [{"role": "user", "content": "ab"}], [{"role": "user", "content": "abc"}]
    for messages in (first, first, second):  # a warm-up, the same prompt, one sharing its template prefix
        assert method.run(messages, 4).token_ids == [7, 7, 7, 7]
    assert llm.prefilled == [4, 4, 4]


def test_unknown_quantization_is_refused_before_loading():
    with pytest.raises(ConfigError, match="int3"):
        BenchConfig(quantize=("int3",))
    with pytest.raises(ConfigError, match="activations='int4'"):
        BenchConfig(activation_rows=("int4",))


def test_an_unknown_transformers_dtype_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="float16.*bfloat16"):
        BenchConfig(transformers_dtype="float16")


def test_a_heads_folder_without_the_heads_the_run_needs_is_refused_before_loading(tmp_path):
    import shutil

    import draftwise.heads

    shipped = draftwise.heads.__path__[0] + "/shipped/smollm2-135m"
    with pytest.raises(ConfigError, match="has no eagle/ or medusa/"):
        BenchConfig(heads=str(tmp_path / "missing"))
    shutil.copytree(f"{shipped}/eagle", tmp_path / "eagle")
    BenchConfig(heads=str(tmp_path))  # every drafter: the rows whose head is there
    BenchConfig(heads=str(tmp_path), drafters=("eagle",))
    with pytest.raises(ConfigError, match="has no medusa/"):
        BenchConfig(heads=str(tmp_path), drafters=("eagle", "medusa"))
    with pytest.raises(ConfigError, match="no head drafter runs"):
        BenchConfig(heads=str(tmp_path), drafters=("ngram",))
    shutil.copytree(f"{shipped}/eagle", tmp_path / "medusa")  # an eagle head where medusa's belongs
    with pytest.raises(ConfigError, match="a head for --drafter eagle, not --drafter medusa"):
        BenchConfig(heads=str(tmp_path))
