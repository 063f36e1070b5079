"""Moving text between two tokenizers without losing a byte: the tricky edges of
cross-vocabulary drafting, as pure functions.

- The committed target tokens may end inside a UTF-8 character (a byte-level token can hold
  half of one). The draft model only ever sees whole characters; the held-back bytes must be
  the start of what it drafts.
- Re-tokenising committed text + draft text can merge across the boundary (" hel" + "lo" is
  one target token " hello"). Only tokens that start exactly at the end of the committed text
  can follow the committed tokens, so the boundary is found by the tokens' byte lengths.
"""

from __future__ import annotations

from draftwise.drafters.vocab import Vocabulary

WINDOW_TOKENS = 8  # committed tokens re-tokenised with the draft text, so the first draft word merges as it would


def complete_length(data: bytes) -> int:
    """Length of the longest prefix of data that does not end inside a UTF-8 character."""
    start = len(data) - 1
    while start >= 0 and len(data) - start < 4 and data[start] & 0xC0 == 0x80:
        start -= 1  # walk back over continuation bytes to the character's lead byte
    if start < 0:
        return len(data)
    lead = data[start]
    needed = 1 if lead < 0x80 else 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 1
    return len(data) if len(data) - start >= needed else start


def split_committed(vocabulary: Vocabulary, token_ids: list[int]) -> tuple[str, bytes]:
    """The committed tokens' text up to the last whole character, and the bytes held back."""
    data = vocabulary.spell(token_ids)
    cut = complete_length(data)
    return data[:cut].decode("utf-8", errors="replace"), data[cut:]


def continuation_tokens(tokenizer, vocabulary: Vocabulary, token_ids: list[int], continuation: bytes,
                        open_ended: bool) -> list[int]:
    """Target token ids that spell `continuation` right after the committed token_ids.

    tokenizer/vocabulary are the target's. open_ended: the continuation was cut by the draft
    budget, not ended, so its last token may be a word the target would spell longer (" hel"
    where the text goes on to " hello"): it is dropped. Returns [] when no exact continuation
    exists (e.g. the draft did not complete a held-back character).
    """
    window = vocabulary.spell(token_ids[-WINDOW_TOKENS:])
    skip = 0
    while skip < len(window) and window[skip] & 0xC0 == 0x80:
        skip += 1  # start the window at a character, not inside one
    window = window[skip:]
    text_bytes = window + continuation
    text_bytes = text_bytes[: complete_length(text_bytes)]
    if len(text_bytes) <= len(window):
        return []
    ids = _encode_exactly(tokenizer, vocabulary, text_bytes)
    tokens = _after_boundary(vocabulary, ids, len(window)) if ids is not None else None
    if tokens is None and complete_length(window) == len(window):
        # The first draft word merged with the committed text's last token (or the window did
        # not re-tokenise exactly): spell the draft text on its own instead.
        tokens = _encode_exactly(tokenizer, vocabulary, text_bytes[len(window):])
    if not tokens:
        return []
    if open_ended and len(tokens) > 1:
        tokens = tokens[:-1]
    return tokens


def _encode_exactly(tokenizer, vocabulary: Vocabulary, data: bytes) -> list[int] | None:
    """Token ids spelling exactly data, or None (invalid UTF-8, or the tokenizer normalises it
    or adds a prefix space, so its tokens would spell something else)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids if vocabulary.spell(ids) == data else None


def _after_boundary(vocabulary: Vocabulary, ids: list[int], boundary: int) -> list[int] | None:
    """ids[j:] where ids[:j] spell exactly `boundary` bytes, or None when a token straddles it."""
    offset = 0
    for index, token_id in enumerate(ids):
        if offset == boundary:
            return ids[index:]
        offset += len(vocabulary.spellings[token_id] or b"")
        if offset > boundary:
            return None
    return None
