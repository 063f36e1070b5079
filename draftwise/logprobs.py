"""Log-probabilities of the generated tokens (OpenAI's `logprobs`), from the target's own logits.

Each committed token was chosen from one row of target logits: the prefill's last row for the
first token, then the verify forward's row before it (the last committed token's row, or the
accepted draft node's). By batch invariance that row is bit-identical to the one plain decoding
computes at the same position, and each row's log-softmax is computed alone, so the reported
numbers are the same floats with any drafter, any draft length and in any batch: speculation
changes how fast they come, never what they are.

They describe the model, not the sampler: log_softmax of the raw logits in float32, before
temperature, top-k, top-p and min-p (the default of OpenAI's API and of vLLM). A token that the
sampler's filters could not have drawn still gets its model probability.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs allows


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float  # natural log of the model's probability of token_id at its position
    top: tuple[tuple[int, float], ...] = ()  # the most probable (token id, logprob) there, most probable first

    def to_dict(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob,
                "top_logprobs": [{"token_id": token, "logprob": logprob} for token, logprob in self.top]}


def token_logprob(logits_row: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    """token_id's log-probability under one row of logits [vocab], and the num_top most probable.
    One row at a time, never a step's rows together: a row's numbers then cannot depend on how
    many tokens its step committed."""
    logprobs = torch.log_softmax(logits_row.float(), dim=-1)
    top = ()
    if num_top:
        values, ids = top_k(logprobs, min(num_top, logprobs.shape[0]))
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token_id, float(logprobs[token_id]), top)


CHUNK = 256


def top_k(row: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(row, k) (values, then ids, most probable first) in two stages: each chunk of 256's
    maximum, then the k chunks with the largest maxima, which hold the k largest values (a chunk
    holding one of them has a maximum at least the k-th largest, and at most k chunks do). On a
    152k-token row, 0.55 ms for torch.topk here against the maxima's 24 us. Among exactly equal
    values the ids may be others than torch.topk's (whose order among ties is unspecified too)."""
    if row.shape[0] <= 16 * CHUNK:
        return torch.topk(row, k)
    pad = -row.shape[0] % CHUNK
    chunks = torch.nn.functional.pad(row, (0, pad), value=float("-inf")).view(-1, CHUNK)
    # amax: max(dim) with its indices is 8x slower. Fewer chunks than k (a short row): all of them.
    best_chunks = torch.topk(chunks.amax(dim=1), min(k, chunks.shape[0])).indices
    values, within = torch.topk(chunks[best_chunks].flatten(), k)
    return values, best_chunks[within // CHUNK] * CHUNK + within % CHUNK


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The UTF-8 bytes token_id stands for, even where they are part of a character (a byte-level
    BPE token holding half of an emoji decodes alone to U+FFFD; its bytes are still exact): the
    bytes of consecutive tokens join into the text's. Special tokens give their own name."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if piece is None:  # an id past the tokenizer's vocabulary (a padded embedding's row)
        return b""
    if int(token_id) in tokenizer.all_special_ids:
        return piece.encode()
    kind = _decoder_kind(tokenizer)
    if kind == "ByteLevel":
        table = _unicode_to_byte()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
    if kind == "SentencePiece":
        match = _BYTE_FALLBACK.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode()
    return tokenizer.decode([int(token_id)]).encode()


def token_text(tokenizer, token_id: int) -> str:
    """token_bytes as text; a part of a character shows as U+FFFD (its bytes are exact)."""
    return token_bytes(tokenizer, token_id).decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=8)  # per tokenizer: serialising one reads its whole vocabulary
def _decoder_kind(tokenizer) -> str:
    """"ByteLevel" (GPT-2's byte-to-character table: SmolLM2, Qwen), "SentencePiece" (U+2581 for a
    space, <0xNN> byte tokens: Gemma, Llama 2), or "" where the tokenizer is neither or not a
    fast one (token_bytes then encodes the token's decoded text)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return ""
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {part.get("type") for part in decoder.get("decoders") or ()}
    if "ByteLevel" in kinds:
        return "ByteLevel"
    if "ByteFallback" in kinds or "Metaspace" in kinds:
        return "SentencePiece"
    return ""


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level table, inverted: printable bytes stand for themselves, the other 68 for
    the characters from U+0100 on, in byte order. (transformers keeps its copy in a module that
    moved between versions; the table itself is fixed by every byte-level BPE vocabulary.)"""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    others = [byte for byte in range(256) if byte not in printable]
    table = {chr(byte): byte for byte in printable}
    table.update({chr(256 + index): byte for index, byte in enumerate(others)})
    return table
