"""The tricky text cases of cross-vocabulary drafting, with real tokenizers: merges across the
committed/draft boundary, characters split across tokens, control tokens, byte spellings."""

from __future__ import annotations

import pytest

from draftwise.drafters.text_bridge import complete_length, continuation_tokens, split_committed
from draftwise.drafters.vocab import PROBE_TEXT, build_vocabulary_map, read_vocabulary


@pytest.fixture(scope="module")
def qwen(qwen_tokenizer):
    return qwen_tokenizer, read_vocabulary(qwen_tokenizer)


@pytest.fixture(scope="module")
def smollm2_vocab(smollm2):
    return smollm2.tokenizer, read_vocabulary(smollm2.tokenizer)


def test_complete_length_stops_before_an_unfinished_character():
    assert complete_length("abc".encode()) == 3
    assert complete_length("é".encode()[:1]) == 0
    assert complete_length("aé".encode()) == 3
    assert complete_length("a日".encode()[:3]) == 1  # two of the three bytes of 日
    assert complete_length("🙂".encode()[:3]) == 0
    assert complete_length("x🙂".encode()) == 5
    assert complete_length(b"") == 0


@pytest.mark.parametrize("tokenizer_fixture", ["qwen_tokenizer", "smollm2_tokenizer", "gemma_tokenizer"])
def test_every_token_of_a_text_spells_its_exact_bytes(request, tokenizer_fixture):
    tokenizer = request.getfixturevalue(tokenizer_fixture)
    vocabulary = read_vocabulary(tokenizer)
    text = PROBE_TEXT + " Ünïcödé — ελληνικά, русский, العربية, 中文。"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert vocabulary.spell(ids) == text.encode("utf-8")
    # Control tokens spell their text and are marked special.
    eos = tokenizer.eos_token_id
    assert vocabulary.spellings[eos] == tokenizer.eos_token.encode() and eos in vocabulary.special


def test_draft_text_merging_with_the_last_committed_token_is_spelled_on_its_own(qwen):
    tokenizer, vocabulary = qwen
    committed = tokenizer.encode("The word is hel", add_special_tokens=False)
    assert vocabulary.spell(committed[-1:]) == b" hel"
    # Re-tokenised together, " hel" + "lo" is one target token " hello": it would straddle the
    # boundary, so the continuation is spelled from the draft text alone.
    assert len(tokenizer.encode("The word is hello world", add_special_tokens=False)) == len(committed) + 1
    tokens = continuation_tokens(tokenizer, vocabulary, committed, b"lo world.", open_ended=False)
    assert vocabulary.spell(tokens) == b"lo world."
    assert tokens == tokenizer.encode("lo world.", add_special_tokens=False)


def test_draft_text_after_a_clean_boundary_gets_the_tokens_the_whole_text_would_have(qwen):
    tokenizer, vocabulary = qwen
    committed = tokenizer.encode("def area(radius):\n", add_special_tokens=False)
    continuation = b"    return 3.14159 * radius ** 2\n"
    tokens = continuation_tokens(tokenizer, vocabulary, committed, continuation, open_ended=False)
    whole = tokenizer.encode("def area(radius):\n    return 3.14159 * radius ** 2\n", add_special_tokens=False)
    assert whole[: len(committed)] == committed  # so the boundary is a token boundary here
    assert tokens == whole[len(committed):]


def test_an_open_ended_draft_drops_its_last_token_which_may_be_a_cut_word(qwen):
    tokenizer, vocabulary = qwen
    committed = tokenizer.encode("She opened the", add_special_tokens=False)
    closed = continuation_tokens(tokenizer, vocabulary, committed, b" door and the wind", open_ended=False)
    cut = continuation_tokens(tokenizer, vocabulary, committed, b" door and the wind", open_ended=True)
    assert cut == closed[:-1] and len(cut) >= 2


def test_a_character_split_across_tokens_is_held_back_and_completed_by_the_draft(smollm2_vocab):
    # SmolLM2's byte-level BPE spells " 日" as three tokens: " \xe6", "\x97", "\xa5".
    tokenizer, vocabulary = smollm2_vocab
    ids = tokenizer.encode("Kanji: 日本", add_special_tokens=False)
    spelled = [vocabulary.spell([i]) for i in ids]
    split = next(index for index, piece in enumerate(spelled) if piece.endswith(b"\xe6"))
    committed = ids[: split + 1]  # ends inside 日
    text, held_back = split_committed(vocabulary, committed)
    assert text == "Kanji: " and held_back == "日".encode()[:1]
    # The draft, which saw only "Kanji: ", writes "日本"; what follows the committed bytes
    # is the rest of 日 and then 本, spelled by the target's tokens exactly.
    draft_bytes = "日本".encode()
    tokens = continuation_tokens(tokenizer, vocabulary, committed, draft_bytes[len(held_back):], open_ended=False)
    assert vocabulary.spell(committed + tokens) == "Kanji: 日本".encode()
    assert tokens[0] == ids[split + 1]


def test_a_draft_that_does_not_finish_the_held_back_character_gives_no_tokens(smollm2_vocab):
    tokenizer, vocabulary = smollm2_vocab
    committed = tokenizer.encode("日", add_special_tokens=False)[:1]
    assert vocabulary.spell(committed) == "日".encode()[:2]
    assert continuation_tokens(tokenizer, vocabulary, committed, b"", open_ended=False) == []
    # A byte that cannot finish 日 leaves no valid text, so nothing is proposed.
    assert continuation_tokens(tokenizer, vocabulary, committed, b"x", open_ended=False) == []


def test_control_tokens_in_context_and_draft_map_to_the_targets_control_tokens(qwen):
    tokenizer, vocabulary = qwen
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    committed = tokenizer.encode(chat, add_special_tokens=False)
    text, held_back = split_committed(vocabulary, committed)
    assert text == chat and held_back == b""  # <|im_start|> etc. are spelled, not dropped
    tokens = continuation_tokens(tokenizer, vocabulary, committed, b"Hello!<|im_end|>", open_ended=False)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokens[-1] == im_end and im_end in vocabulary.special
    assert vocabulary.spell(tokens) == b"Hello!<|im_end|>"


def test_the_vocabulary_map_pairs_tokens_by_spelling_and_controls_only_with_controls(qwen, smollm2_vocab):
    qwen_tokenizer, qwen_vocab = qwen
    smol_tokenizer, smol_vocab = smollm2_vocab
    vocabulary_map = build_vocabulary_map(qwen_vocab, smol_vocab)
    for word in (" hello", "def", " the", "\n"):
        (draft_id,) = smol_tokenizer.encode(word, add_special_tokens=False)
        (target_id,) = qwen_tokenizer.encode(word, add_special_tokens=False)
        assert vocabulary_map.draft_to_target[draft_id] == target_id
    # Both are ChatML models: <|im_end|> is a control token in both and pairs up.
    assert vocabulary_map.draft_to_target[smol_tokenizer.convert_tokens_to_ids("<|im_end|>")] == \
        qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")
    # Every pair spells the same bytes.
    for draft_id in vocabulary_map.in_intersection.nonzero().squeeze(1)[::997].tolist():
        target_id = int(vocabulary_map.draft_to_target[draft_id])
        assert smol_vocab.spellings[draft_id] == qwen_vocab.spellings[target_id]
        assert (draft_id in smol_vocab.special) == (target_id in qwen_vocab.special)
    assert 0.5 < vocabulary_map.overlap < 1.0  # partial overlap, as measured: 0.80
