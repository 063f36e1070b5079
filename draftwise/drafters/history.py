"""Drafting from what the engine wrote before: an n-gram table over earlier answers, shared by
every request of an engine, grown into a tree with this request's own prompt lookup.

Prompt lookup (NgramDrafter) copies what the request's own context repeats; it has nothing to
offer where an answer says what nobody said in its prompt, which is most of a chat. But answers
repeat each other: the phrases a model opens with, explains with and closes with, a format a
batch of labelling prompts all answer in, the same question asked again. NgramHistory counts,
for every context of 1 to max_n tokens, which token followed it in the answers this engine wrote
(all requests', live as they are committed, in a sliding window of `capacity` tokens), and
HistoryDrafter grows a tree from those counts, most probable paths first (a child's probability
is its count over its context's total plus one, the context being the longest one the table
knows), then merges the request's own prompt lookup into it as one more path (lookup.merge_path,
as the heads' trees take it), each source's probabilities scaled by how often its guesses were
right on this request. The draft-length policy trims the tree by its calibrated scores, as it
does a head's.

The idea is SuffixDecoding's (Oliaro et al. 2024, arXiv 2411.04975: suffix trees over earlier
outputs, speculation trees by frequency) and llama.cpp's lookup decoding with a dynamic n-gram
cache; this is our own n-gram table. Every draft token is verified by the target, so what the
table holds changes speed only, never the output (greedy, and coupled sampling's same seed same
text; with `sampling_mode="rejection"` a seeded request's text may depend on what the engine
answered before, as it may on any draft).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import os
from array import array
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import torch

from draftwise.config import SamplingParams
from draftwise.drafters.base import Draft, best_tree_draft, empty_draft
from draftwise.drafters.lookup import LOOKUP_LOG_PROBABILITY, merge_path
from draftwise.errors import ConfigError

_MIX = 0x9E3779B97F4A7C15  # a 64-bit odd constant (the golden ratio's): the context hashes' multiplier
_MASK = (1 << 64) - 1
_COUNT_BITS = 20  # a single continuation is stored as token << _COUNT_BITS | count (count < 2^20)
_COUNT_MASK = (1 << _COUNT_BITS) - 1
HISTORY_FORMAT = "draftwise-ngram-history-1"  # a history file's metadata "format"
MOST_LIKELY = 0.99  # the highest chance a node's step is given (a reliability may pass 1)


def context_keys(tokens: Sequence[int], end: int, max_n: int) -> list[int]:
    """The table keys of the contexts ending before position `end`: [the last 1 token's, the last
    2 tokens', ...], at most max_n of them (fewer near the start). A 64-bit hash of the tokens
    read backwards, so each longer context's key extends the shorter one's; two contexts sharing
    a key (a chance of about n^2 / 2^64 among n contexts) cost a poor draft, never a wrong token."""
    keys, key = [], 0
    for n in range(1, min(max_n, end) + 1):
        key = ((key * _MIX) ^ (tokens[end - n] + 1)) & _MASK
        keys.append(key)
    return keys


def tokenizer_id(tokenizer) -> str:
    """What a history file's token ids are ids of: a digest of the tokenizer's vocabulary (two
    models sharing a tokenizer, Qwen2.5-Coder 0.5B and 1.5B, share their histories)."""
    vocabulary = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocabulary).encode()).hexdigest()[:32]


class NgramHistory:
    """What followed each context of 1..max_n tokens in the text inserted, over the last
    `capacity` tokens inserted (older pieces are taken out whole, their counts undone).

    file: where save() keeps the pieces between processes (a server's restart, one `draftwise
    generate` after another); read now if it exists. tokenizer: tokenizer_id() of the model whose
    ids the pieces are, checked against the file's."""

    def __init__(self, max_n: int = 4, capacity: int = 200_000, file: Path | str | None = None,
                 tokenizer: str = "") -> None:
        if max_n < 1:
            raise ConfigError(f"max_n={max_n}: the history's contexts need at least 1 token.")
        if capacity < 0:
            raise ConfigError(f"history capacity={capacity} tokens is invalid: use 0 (keep no history) or more.")
        self.max_n = max_n
        self.capacity = capacity
        self.file = None if file is None else Path(file)
        self.tokenizer = tokenizer
        # context key -> its continuations: token << _COUNT_BITS | count while there is one (most
        # contexts: a third of the memory of a dict each), then {token: count}
        self.table: dict[int, int | dict[int, int]] = {}
        # (serial number, tokens, first counted position), oldest first; 8 bytes a token as an array
        self.pieces: deque[tuple[int, Sequence[int], int]] = deque()
        self.num_tokens = 0  # tokens counted in the window
        self.num_inserted = 0  # pieces ever inserted: the next one's serial number
        if self.file is not None and self.file.exists():
            self._read(self.file)

    def __len__(self) -> int:
        return self.num_tokens

    def insert(self, tokens: Sequence[int], first: int) -> None:
        """Count tokens[first:], each after its contexts (which may reach back before `first`)."""
        first = max(first, 1)  # the first token has no context
        if first >= len(tokens) or self.capacity == 0:
            return
        self._count(tokens, first, +1)
        self.pieces.append((self.num_inserted, tokens, first))
        self.num_inserted += 1
        self.num_tokens += len(tokens) - first
        while self.num_tokens > self.capacity:
            _, old, old_first = self.pieces.popleft()
            self._count(old, old_first, -1)
            self.num_tokens -= len(old) - old_first

    def _count(self, tokens: Sequence[int], first: int, change: int) -> None:
        table = self.table
        for position in range(first, len(tokens)):
            token = tokens[position]
            for key in context_keys(tokens, position, self.max_n):
                entry = table.get(key)
                if entry is None:  # change is +1: a count can only be taken out after it was put in
                    table[key] = token << _COUNT_BITS | 1
                elif isinstance(entry, int):
                    if entry >> _COUNT_BITS != token:
                        table[key] = {entry >> _COUNT_BITS: entry & _COUNT_MASK, token: 1}
                    elif (entry & _COUNT_MASK) + change == _COUNT_MASK + 1:  # past 20 bits: a dict holds it
                        table[key] = {token: _COUNT_MASK + 1}
                    elif (entry & _COUNT_MASK) + change:
                        table[key] = entry + change
                    else:
                        del table[key]
                else:
                    count = entry.get(token, 0) + change
                    if count:
                        entry[token] = count
                    else:
                        del entry[token]
                        if not entry:  # (a count past 20 bits was alone in its dict)
                            del table[key]
                        elif len(entry) == 1:
                            (only, left), = entry.items()
                            if left <= _COUNT_MASK:
                                table[key] = only << _COUNT_BITS | left

    def continuations(self, keys: list[int]) -> dict[int, int]:
        """{token: count} after the longest of these contexts (context_keys' order) that the
        table knows; empty if none. The table's own dict where it keeps one: read, never change."""
        for key in reversed(keys):
            entry = self.table.get(key)
            if entry is None:
                continue
            if isinstance(entry, int):
                return {entry >> _COUNT_BITS: entry & _COUNT_MASK}
            return entry
        return {}

    def save(self) -> None:
        """Write the window's pieces to `file` (safetensors: the tokens, each piece's length and
        first counted position; the tokenizer's id in its metadata), replacing it whole."""
        from safetensors.torch import save_file

        if self.file is None:
            raise ConfigError("this history has no file to save to: give NgramHistory(file=...) "
                              "(--history-file PATH).")
        pieces = list(self.pieces)
        tokens = [token for _, piece, _ in pieces for token in piece]
        temporary = self.file.with_name(self.file.name + ".partial")
        save_file({"tokens": torch.tensor(tokens, dtype=torch.long),
                   "lengths": torch.tensor([len(piece) for _, piece, _ in pieces], dtype=torch.long),
                   "firsts": torch.tensor([first for _, _, first in pieces], dtype=torch.long)},
                  str(temporary), metadata={"format": HISTORY_FORMAT, "tokenizer": self.tokenizer})
        os.replace(temporary, self.file)  # a reader never sees half a file

    def _read(self, path: Path) -> None:
        from safetensors import SafetensorError, safe_open
        from safetensors.torch import load_file

        try:
            with safe_open(str(path), "pt") as opened:
                metadata = opened.metadata() or {}
            arrays = load_file(str(path))
            tokens, lengths, firsts = arrays["tokens"].tolist(), arrays["lengths"].tolist(), arrays["firsts"].tolist()
        except (SafetensorError, KeyError, OSError, ValueError) as error:
            raise ConfigError(f"--history-file {path} is not a history draftwise wrote ({error}): give another "
                              "path, or remove the file to start an empty history there.") from None
        if metadata.get("format") != HISTORY_FORMAT:
            raise ConfigError(f"--history-file {path} is not a history draftwise wrote (format "
                              f"{metadata.get('format')!r}): give another path, or remove the file.")
        if metadata.get("tokenizer") != self.tokenizer:
            raise ConfigError(f"--history-file {path} holds the token ids of another tokenizer than this model's: "
                              "its ids would mean other words here. Give a history file of this model's (or of one "
                              "sharing its tokenizer), or a new path.")
        start = 0
        for length, first in zip(lengths, firsts):
            self.insert(array("q", tokens[start:start + length]), first)
            start += length

    def mark(self) -> int:
        """A point to rewind to (rewind): the serial number the next piece will have."""
        return self.num_inserted

    def rewind(self, mark: int) -> None:
        """Take out every piece inserted since mark() returned `mark` (a benchmark's repeats must
        not draft from their own earlier answers). Older pieces the window dropped meanwhile
        stay dropped."""
        while self.pieces and self.pieces[-1][0] >= mark:
            _, tokens, first = self.pieces.pop()
            self._count(tokens, first, -1)
            self.num_tokens -= len(tokens) - first


class Reliability:
    """How often one source's guesses turn out right, from the tokens committed after them: a
    decayed ratio of hits to what the source predicted (its probabilities summed), starting
    from `prior` (prior_weight observations' worth). A node's score is then the source's own
    probability times this, so that a source proving better or worse than it claims on this
    text (prompt lookup on a translation, the history on a chat) ranks its nodes accordingly."""

    DECAY = 0.95  # per observation: the text changes as an answer goes on

    def __init__(self, prior: float, prior_weight: float = 4.0) -> None:
        self.hits, self.predicted = prior * prior_weight, prior_weight

    def observe(self, predicted: float, hit: bool) -> None:
        self.hits = self.DECAY * self.hits + hit
        self.predicted = self.DECAY * self.predicted + predicted

    @property
    def ratio(self) -> float:
        return self.hits / self.predicted


class HistoryDrafter:
    """A tree from the engine's answers so far (NgramHistory) and the request's prompt lookup.
    Forks (one per request of a batch: fork_drafter's shallow copy) share the history."""

    sequential = False  # one tree per step, free to draft; the policy trims nodes by score

    # Children per expanded node. Chosen in an offline replay (not in the repository) of 400
    # SmolLM2 answers to its own Magpie questions, each drafted from the ones before: 10-node
    # trees of 3 children committed 2.00 tokens a step against prompt lookup's 1.57; not tuned
    # further. The measured speed-ups: README, "Drafting from earlier answers".
    BRANCH = 3

    def __init__(self, history: NgramHistory, min_n: int = 1, max_n: int = 4, lookup: int = 10) -> None:
        """history: the table to draft from and to add this engine's answers to; min_n, max_n: the
        prompt lookup's match lengths (NgramDrafter's); lookup: the most tokens it copies (0: none)."""
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"ngram_min={min_n}, ngram_max={max_n} are invalid: need 1 <= ngram_min <= ngram_max.")
        if lookup < 0:
            raise ConfigError(f"lookup={lookup}: the most tokens copied by prompt lookup must be 0 (none) or more.")
        self.history = history
        self.min_n, self.max_n, self.lookup = min_n, max_n, lookup
        self.begin(None, None, 0)

    def begin(self, params: SamplingParams | None, generator: torch.Generator | None, max_length: int) -> None:
        self.num_counted: int | None = None  # answer tokens counted into the history up to here
        # The request's own text: context key -> the latest position it was followed from (prompt
        # lookup's latest earlier match, kept as the context grows instead of searched each step)
        self.latest: dict[int, int] = {}
        self.num_indexed = 1  # positions 1 .. num_indexed - 1 are in `latest`
        # How right each source has been on this request (scored against the committed tokens at
        # the next step): prompt lookup's chance a copied token is right (its prior: TreeLookup's
        # 0.8), and the history's hits per probability it gave (prior: its counts are calibrated).
        self.lookup_reliability = Reliability(math.exp(LOOKUP_LOG_PROBABILITY))
        self.history_reliability = Reliability(1.0)
        # The last step's guesses: (context length, the lookup's path, the history's children
        # per expanded path {path: {token: probability}}), scored when the next step comes
        self.last: tuple[int, list[int], dict[tuple[int, ...], dict[int, float]]] | None = None

    def propose(self, context: torch.Tensor, num_draft_tokens: int) -> Draft:
        tokens = context.tolist()
        self._count_new(tokens)
        self._score_last(tokens)
        if num_draft_tokens < 1:
            return empty_draft()
        root_keys = context_keys(tokens, len(tokens), max(self.max_n, self.history.max_n))
        expanded: dict[tuple[int, ...], dict[int, float]] = {}
        nodes, parents, scores, depths = self._grow(tokens, root_keys, num_draft_tokens, expanded)
        copied = self._lookup(tokens, root_keys) if self.lookup else []
        self.last = (len(tokens), copied, expanded)
        if copied:
            merge_path(copied, nodes, parents, scores, depths, math.log(min(self.lookup_reliability.ratio, MOST_LIKELY)))
        if not nodes:
            return empty_draft()
        return best_tree_draft(nodes, parents, scores, depths, num_draft_tokens, key="history")

    def _score_last(self, tokens: list[int]) -> None:
        """Score the last step's guesses against what was committed since (the accepted tokens
        and the target's own next one): each source, down the committed path, until it missed."""
        if self.last is None:
            return
        length, copied, expanded = self.last
        self.last = None
        committed = tokens[length:]
        for depth, token in enumerate(committed[:len(copied)]):
            # The lookup's claim is its current ratio itself, so the ratio settles at the square
            # root of the hit rate (0.71 for a copy right half the time), not the hit rate. Kept as
            # measured: observing a fixed claim (settling at the hit rate) drafted worse where
            # answers copy (SmolLM2, 400 answers: code edits 1.88x against 1.96x plain, RAG 1.99x
            # against 2.14x; chat and math the same): a copy right at one depth is likelier right at
            # the next than one probability per depth says.
            self.lookup_reliability.observe(self.lookup_reliability.ratio, token == copied[depth])
            if token != copied[depth]:
                break
        for depth, token in enumerate(committed):
            children = expanded.get(tuple(committed[:depth]))
            if children is None:
                break
            self.history_reliability.observe(sum(children.values()), token in children)
            if token not in children:
                break

    def _grow(self, tokens: list[int], root_keys: list[int], num_nodes: int,
              expanded: dict[tuple[int, ...], dict[int, float]]) -> tuple[list[int], list[int], list[float], list[int]]:
        """The history's candidate tree, most probable nodes first: a node's children are the
        BRANCH likeliest continuations of its path (count / (total + 1) after the longest context
        the history knows); expanding nodes in order of path probability, the first num_nodes
        expanded are the num_nodes most probable of any tree (a child is never likelier than its
        parent), so growth stops there. Each expanded path's children and their probabilities go
        into `expanded`. -> (token, parent, log path probability, depth) lists; a probability is
        the count's share times the history's reliability on this request."""
        history, max_n = self.history, self.history.max_n
        reliability = self.history_reliability.ratio
        nodes: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        depths: list[int] = []
        paths: list[list[int]] = []  # each node's tokens from the root, for its contexts' keys
        frontier = [(0.0, -1)]  # (-log path probability, node)
        num_expanded = -1  # the root's expansion is not a node
        while frontier and num_expanded < num_nodes:
            negative, node = heapq.heappop(frontier)
            num_expanded += 1
            if node < 0:
                path, keys = [], root_keys[:max_n]
            else:
                path = paths[node]
                tail = tokens[-max_n:] + path
                keys = context_keys(tail, len(tail), max_n)
            counts = history.continuations(keys)
            if not counts:
                continue
            total = sum(counts.values()) + 1  # + 1: one sighting is a guess, not a certainty
            likeliest = sorted(counts.items(), key=lambda item: -item[1])[:self.BRANCH] if len(counts) > 1 else counts.items()
            expanded[tuple(path)] = {token: count / total for token, count in likeliest}
            for token, count in likeliest:
                score = math.log(min(count / total * reliability, MOST_LIKELY)) - negative
                nodes.append(token)
                parents.append(node)
                scores.append(score)
                depths.append(len(path) + 1)
                paths.append(path + [token])
                heapq.heappush(frontier, (-score, len(nodes) - 1))
        return nodes, parents, scores, depths

    def _lookup(self, tokens: list[int], root_keys: list[int]) -> list[int]:
        """Prompt lookup (NgramDrafter's): up to `lookup` tokens that followed the latest earlier
        occurrence of the context's last n tokens, the longest n of min_n..max_n that occurred."""
        for n in range(min(self.max_n, len(root_keys)), self.min_n - 1, -1):
            start = self.latest.get(root_keys[n - 1])
            if start is not None:
                return tokens[start:start + self.lookup]
        return []

    def rollback(self, num_valid: int) -> None:
        pass  # only committed context is ever counted (propose's and end's)

    def end(self, context: torch.Tensor) -> None:
        """The request ended with this committed context: count what no step counted yet."""
        self._count_new(context.tolist())

    def _count_new(self, tokens: list[int]) -> None:
        """Index the committed tokens not indexed yet: every position into `latest`, and the
        answer's tokens into the history, each after its contexts. The request's first call starts
        the answer at its last token (the first the target chose); the prompt, another user's
        text, is not counted, but its last tokens are the contexts the answer's first follows."""
        if self.num_counted is None:
            self.num_counted = max(len(tokens) - 1, 0)
        # A context shorter than the last: a grammar's forced tokens, drafted from last step, were
        # not all committed; go on from here (what they left in the tables costs speed, not tokens).
        self.num_indexed = min(self.num_indexed, max(len(tokens), 1))
        self.num_counted = min(self.num_counted, len(tokens))
        for position in range(self.num_indexed, len(tokens)):
            for key in context_keys(tokens, position, self.max_n):
                self.latest[key] = position
        self.num_indexed = max(self.num_indexed, len(tokens))
        if len(tokens) > self.num_counted:
            start = max(self.num_counted - self.history.max_n, 0)
            self.history.insert(array("q", tokens[start:]), self.num_counted - start)
            self.num_counted = len(tokens)
