"""What every token of a tokenizer spells, in bytes, and the map between two vocabularies.

Cross-vocabulary drafting compares tokens of two tokenizers by what they spell. Text would be
lossy: a byte-level BPE token can hold half of a UTF-8 character ("æ" + "Ĺ¥" in GPT-2 notation
for 日), which decodes alone to U+FFFD. Bytes are exact, so this module reads each token's
bytes from the tokenizer's own notation:
  - byte-level BPE (GPT-2, Qwen, SmolLM2, Llama 3): each character stands for one byte;
  - SentencePiece-style (Gemma, Llama 2, Mistral): "▁" is a space, "<0xNN>" is one raw byte;
  - added tokens (specials such as <|im_end|>, and literal added words): their content.
A tokenizer in another notation is refused, never guessed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch

from draftwise.errors import IncompatibleDrafterError

# Text every supported tokenizer must spell back exactly, byte for byte, before it is trusted:
# ASCII, accents, CJK, emoji, code, newlines and runs of spaces.
PROBE_TEXT = "Hello, wörld! Ça va? 日本語のテキスト 🙂\n\ndef f(x):\n    return x  # done\t€"
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """spellings[id] is the bytes token id stands for (None: it stands for nothing, e.g. an
    id past the tokenizer's end); special[id] says it is a control token such as EOS."""

    spellings: tuple[bytes | None, ...]
    special: frozenset[int]

    def spell(self, token_ids: list[int]) -> bytes:
        return b"".join(self.spellings[i] or b"" for i in token_ids)


def read_vocabulary(tokenizer, size: int | None = None) -> Vocabulary:
    """The bytes of each of `size` ids (default: the tokenizer's length; a model's embedding
    may have more rows than its tokenizer has tokens)."""
    size = max(size or 0, len(tokenizer))
    notation = _notation(tokenizer)
    spellings: list[bytes | None] = [None] * size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < size:
            spellings[token_id] = _spell(token, notation)
    special = set()
    for token_id, added in tokenizer.added_tokens_decoder.items():
        if token_id < size:
            spellings[token_id] = added.content.encode("utf-8")
            if added.special:
                special.add(token_id)
    vocabulary = Vocabulary(tuple(spellings), frozenset(special))
    probe_ids = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    if vocabulary.spell(probe_ids) != PROBE_TEXT.encode("utf-8"):
        raise IncompatibleDrafterError(
            f"cannot read the spelling of {type(tokenizer).__name__}'s tokens ({notation} notation): "
            "cross-vocabulary drafting needs a byte-level BPE or SentencePiece tokenizer. Use a draft "
            "model with another tokenizer, or --drafter ngram."
        )
    return vocabulary


def _notation(tokenizer) -> str:
    decoder = json.loads(tokenizer.backend_tokenizer.decoder.__getstate__()) if tokenizer.backend_tokenizer.decoder else {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", [])}
    if "ByteLevel" in kinds:
        return "byte-level"
    if "ByteFallback" in kinds or "Metaspace" in kinds:
        return "sentencepiece"
    return "unknown"


def _spell(token: str, notation: str) -> bytes | None:
    if notation == "byte-level":
        try:
            return bytes(_UNICODE_TO_BYTE[char] for char in token)
        except KeyError:
            return None  # not in byte notation: an added token, spelled from its content later
    if notation == "sentencepiece":
        piece = _BYTE_PIECE.match(token)
        return bytes([int(piece.group(1), 16)]) if piece else token.replace("▁", " ").encode("utf-8")
    return None


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (used by every byte-level BPE)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {char: byte for byte, char in _byte_to_unicode().items()}


@dataclass(frozen=True, slots=True)
class VocabularyMap:
    """Draft ids -> target ids for tokens that spell the same bytes in both vocabularies (the
    intersection), and the share of the draft vocabulary that has such a twin."""

    draft_to_target: torch.Tensor  # [draft_vocab] long, -1 where the draft token has no twin
    num_shared: int
    num_draft_tokens: int

    @property
    def in_intersection(self) -> torch.Tensor:  # [draft_vocab] bool
        return self.draft_to_target >= 0

    @property
    def overlap(self) -> float:
        return self.num_shared / max(1, self.num_draft_tokens)


def build_vocabulary_map(target: Vocabulary, draft: Vocabulary) -> VocabularyMap:
    """Pair tokens spelling the same bytes; a control token only pairs with a control token."""
    by_spelling: dict[tuple[bool, bytes], int] = {}
    for token_id, spelling in enumerate(target.spellings):
        if spelling:
            by_spelling.setdefault((token_id in target.special, spelling), token_id)  # lowest id wins
    mapping = [by_spelling.get((token_id in draft.special, spelling), -1) if spelling else -1
               for token_id, spelling in enumerate(draft.spellings)]
    draft_to_target = torch.tensor(mapping, dtype=torch.long)
    num_known = sum(1 for spelling in draft.spellings if spelling)
    return VocabularyMap(draft_to_target, int((draft_to_target >= 0).sum()), num_known)


_PAIRS: dict[tuple[str, int, str, int], tuple[Vocabulary, Vocabulary, VocabularyMap]] = {}


def vocabulary_pair(target_tokenizer, target_size: int, draft_tokenizer, draft_size: int,
                    ) -> tuple[Vocabulary, Vocabulary, VocabularyMap]:
    """Both vocabularies and their map, built once per pair of tokenizers in a process (about
    a second for Gemma's 262k tokens, a fifth of that for SmolLM2's 49k)."""
    key = (target_tokenizer.name_or_path, target_size, draft_tokenizer.name_or_path, draft_size)
    if key not in _PAIRS:
        target = read_vocabulary(target_tokenizer, target_size)
        draft = read_vocabulary(draft_tokenizer, draft_size)
        _PAIRS[key] = (target, draft, build_vocabulary_map(target, draft))
    return _PAIRS[key]
