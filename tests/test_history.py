"""--drafter history: the n-gram table over earlier answers counts exactly what its window holds
(insertions, evictions and rewinds undo each other), its prompt lookup is NgramDrafter's, and on
the real SmolLM2-135M it drafts from what the engine answered before (more tokens a forward than
prompt lookup alone once it has) while every output stays plain decoding's, alone and in a batch."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import draftwise
from draftwise import SamplingParams
from draftwise.bench.methods import DraftwiseMethod
from draftwise.config import SpecConfig
from draftwise.drafters.history import HistoryDrafter, NgramHistory, context_keys
from draftwise.drafters.ngram import NgramDrafter
from draftwise.engine import Engine
from draftwise.errors import ConfigError
from tests.conftest import PROMPTS

pieces = st.lists(st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=30), st.integers(0, 6)),
                  min_size=1, max_size=12)


def recount(kept: list[tuple[list[int], int]], max_n: int) -> dict[int, dict[int, int]]:
    """The table the kept pieces should give: for each context key, its continuations' counts."""
    table: dict[int, dict[int, int]] = {}
    for tokens, first in kept:
        for position in range(max(first, 1), len(tokens)):
            for key in context_keys(tokens, position, max_n):
                counts = table.setdefault(key, {})
                counts[tokens[position]] = counts.get(tokens[position], 0) + 1
    return table


def as_counts(history: NgramHistory) -> dict[int, dict[int, int]]:
    return {key: dict(history.continuations([key])) for key in history.table}


@settings(max_examples=60, deadline=None)
@given(pieces, st.integers(1, 4), st.integers(0, 80))
def test_the_table_counts_exactly_the_pieces_its_window_keeps(inserted, max_n, capacity):
    history = NgramHistory(max_n, capacity)
    for tokens, first in inserted:
        history.insert(tokens, first)
    # The window: the latest pieces whose counted tokens fit in capacity (older ones dropped whole).
    kept, total = [], 0
    for tokens, first in reversed(inserted):
        size = max(len(tokens) - max(first, 1), 0)
        if not size or capacity == 0:
            continue
        if total + size > capacity:
            break
        kept.insert(0, (tokens, first))
        total += size
    assert len(history) == total
    assert as_counts(history) == recount(kept, max_n)


@settings(max_examples=80, deadline=None)
@given(pieces, pieces, st.integers(0, 120))
def test_a_rewind_takes_out_exactly_what_came_after_the_mark(before, after, capacity):
    history = NgramHistory(3, capacity)
    for tokens, first in before:
        history.insert(tokens, first)
    mark = history.mark()
    for tokens, first in after:
        history.insert(tokens, first)
    # What should remain: the pieces from before the mark that the window still holds.
    kept = [(tokens, first) for serial, tokens, first in history.pieces if serial < mark]
    history.rewind(mark)
    assert as_counts(history) == recount(kept, 3)
    assert len(history) == sum(len(tokens) - max(first, 1) for tokens, first in kept)


def test_counts_past_twenty_bits_keep_their_token():
    history = NgramHistory(1, 10**7)
    history.insert([7] * (2**20 + 3), 1)  # "7" followed by 7, 2^20 + 2 times
    assert history.continuations(context_keys([7], 1, 1)) == {7: 2**20 + 2}
    history.rewind(0)
    assert history.table == {} and len(history) == 0


def test_continuations_come_from_the_longest_context_the_table_knows():
    history = NgramHistory(3, 1000)
    history.insert([1, 2, 3, 9], 1)  # ... 2 3 -> 9
    history.insert([7, 3, 4], 1)  # 3 -> 4 once more
    assert history.continuations(context_keys([5, 2, 3], 3, 3)) == {9: 1}  # "2 3" known: its continuation
    assert history.continuations(context_keys([5, 6, 3], 3, 3)) == {9: 1, 4: 1}  # only "3": both
    assert history.continuations(context_keys([5, 6, 8], 3, 3)) == {}


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 3), st.integers(0, 3), st.integers(1, 12))
def test_its_prompt_lookup_is_ngram_drafters(tokens, min_n, extra, length):
    max_n = min_n + extra
    drafter = HistoryDrafter(NgramHistory(max_n, 0), min_n, max_n, lookup=length)
    drafter.begin(SamplingParams(), torch.Generator(), 100)
    # The context grows a token at a time, as it does while decoding: the index follows it.
    for end in range(1, len(tokens) + 1):
        draft = drafter.propose(torch.tensor(tokens[:end]), length)
        expected = NgramDrafter(min_n, max_n).propose(torch.tensor(tokens[:end]), length).tokens.tolist()
        assert draft.tokens.tolist() == expected  # an empty history: the tree is the lookup's chain


def test_the_tree_grows_the_likeliest_continuations_first():
    history = NgramHistory(2, 1000)
    for _ in range(3):
        history.insert([1, 2, 3, 4], 1)  # after 1: 2 (3 times)
    history.insert([1, 5], 1)  # after 1: 5 (once)
    drafter = HistoryDrafter(history, lookup=0)
    drafter.begin(SamplingParams(), torch.Generator(), 100)
    draft = drafter.propose(torch.tensor([9, 1]), 4)
    assert draft.tokens.tolist() == [2, 3, 4, 5]  # 2 (3/5), then 3 and 4 (3/4 each), then 5 (1/5)
    assert draft.parents.tolist() == [-1, 0, 1, -1]
    assert torch.allclose(draft.scores, torch.tensor([3 / 5, 3 / 5 * 3 / 4, 3 / 5 * 9 / 16, 1 / 5]))
    # Its own request's answer joined the history: "9 1" is context, the answer starts at "1".
    assert history.continuations(context_keys([9], 1, 2)) == {1: 1}


def test_bad_settings_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="history capacity=-1 tokens is invalid"):
        NgramHistory(4, -1)
    with pytest.raises(ConfigError, match="history_tokens=5 is only read by drafter='history'"):
        SpecConfig(drafter="ngram", history_tokens=5)
    with pytest.raises(ConfigError, match="history_tokens=-2 is invalid"):
        SpecConfig(drafter="history", history_tokens=-2)


@pytest.fixture(scope="module")
def engine():
    return draftwise.load("smollm2-135m", drafter="history", progress=False)


@pytest.fixture(scope="module")
def plain(engine):
    return Engine(engine.target)


def test_later_answers_draft_from_earlier_ones_and_equal_plain_decoding(engine, plain):
    # The same question asked three times (a user retrying, an evaluation rerun): once the first
    # answer is in the history, the others commit more tokens a forward than the first did, and
    # all three are plain decoding's tokens.
    questions = [PROMPTS[7]] * 3
    params = SamplingParams(max_new_tokens=48)
    first, *later = [engine.generate(question, params) for question in questions]
    for question, result in zip(questions, [first, *later]):
        assert result.token_ids == plain.generate(question, params).token_ids
    assert all(result.metrics.mean_accepted_length > first.metrics.mean_accepted_length + 0.5 for result in later)
    assert len(engine.drafter.history) >= 3 * len(first.token_ids) - 3


def test_a_batch_drafting_from_one_history_gives_each_prompt_plain_decodings_tokens(engine, plain):
    params = [SamplingParams(max_new_tokens=12 + 8 * (index % 4)) for index in range(len(PROMPTS))]
    results = engine.generate_batch(PROMPTS, params, max_batch=4)
    for prompt, each, result in zip(PROMPTS, params, results):
        assert result.token_ids == plain.generate(prompt, each).token_ids
    assert sum(result.metrics.num_accepted_tokens for result in results) > 0


def test_seeded_coupled_sampling_gives_the_same_text_with_or_without_a_history(engine, plain):
    sampled = dict(max_new_tokens=32, temperature=0.8, top_p=0.95, seed=11)
    prompts = random.Random(3).sample(PROMPTS, 4)
    assert [engine.generate(prompt, **sampled).token_ids for prompt in prompts] == \
           [plain.generate(prompt, **sampled).token_ids for prompt in prompts]


def test_the_benchs_repeats_of_a_prompt_never_draft_from_their_own_answer(engine):
    # The bench runs a prompt several times (warm-up, repeats): each run must find the history as
    # the first did, or the repeats would copy their own answer and report a false speed-up.
    method = DraftwiseMethod("draftwise history", engine, reference=None)
    before = len(engine.drafter.history)
    runs = [method.run(PROMPTS[9], 40) for _ in range(3)]
    assert [run.token_ids for run in runs[1:]] == [runs[0].token_ids] * 2
    assert [run.metrics.num_accepted_tokens for run in runs[1:]] == [runs[0].metrics.num_accepted_tokens] * 2
    assert len(engine.drafter.history) == before + len(runs[0].token_ids)  # one answer kept, not three
    following = method.run(PROMPTS[4], 40)  # the next prompt drafts from the last one's answer, and adds its own
    assert len(engine.drafter.history) == before + len(runs[0].token_ids) + len(following.token_ids)


def test_a_drafter_whose_end_fails_leaves_the_answer_whole(engine, plain, caplog):
    class Failing(HistoryDrafter):
        def end(self, context):
            raise RuntimeError("bookkeeping broke")

    failing = Engine(engine.target, Failing(NgramHistory()), 8)
    with caplog.at_level("ERROR"):
        result = failing.generate(PROMPTS[5], max_new_tokens=24)
    assert result.token_ids == plain.generate(PROMPTS[5], max_new_tokens=24).token_ids
    assert result.finish_reason in ("stop", "length")
    assert "the drafter's end() failed" in caplog.text and "bookkeeping broke" in caplog.text


def test_a_history_file_keeps_the_window_between_processes(tmp_path):
    path = tmp_path / "history.safetensors"
    written = NgramHistory(3, 40, path, tokenizer="vocabulary A")
    for start in range(6):
        written.insert([start, 1, 2, 3, start + 4, 5, 6, 7, 8, 9], 2)
    written.save()
    assert not list(tmp_path.glob("*.partial"))
    read = NgramHistory(3, 40, path, tokenizer="vocabulary A")
    assert as_counts(read) == as_counts(written) and len(read) == len(written) == 40
    smaller = NgramHistory(3, 16, path, tokenizer="vocabulary A")  # a smaller window keeps the latest pieces
    assert as_counts(smaller) == recount([(tokens, first) for _, tokens, first in list(written.pieces)[-2:]], 3)
    with pytest.raises(ConfigError, match="another tokenizer than this model's"):
        NgramHistory(3, 40, path, tokenizer="vocabulary B")
    path.write_bytes(b"not a history")
    with pytest.raises(ConfigError, match="is not a history draftwise wrote"):
        NgramHistory(3, 40, path, tokenizer="vocabulary A")
    with pytest.raises(ConfigError, match="no file to save to"):
        NgramHistory().save()


def test_generate_with_a_history_file_drafts_from_the_runs_before(capsys, tmp_path):
    import json

    from draftwise.cli import main

    path = tmp_path / "history.safetensors"
    argv = ["generate", "List five fruits that are rich in vitamin C.", "--chat", "--drafter", "history",
            "--history-file", str(path), "--max-new-tokens", "48", "--json", "--quiet"]
    runs = []
    for _ in range(2):
        assert main(argv) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["token_ids"] == runs[1]["token_ids"]
    assert runs[1]["metrics"]["mean_accepted_length"] > runs[0]["metrics"]["mean_accepted_length"] + 1
    assert main(["generate", "hi", "--drafter", "ngram", "--history-file", str(path)]) == 2
    assert "only read by drafter='history'" in capsys.readouterr().err
