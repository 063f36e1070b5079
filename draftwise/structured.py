"""Structured outputs: text a grammar allows (any JSON object, a JSON schema, a regex, a Lark
grammar), lossless under speculation.

llguidance (Microsoft's Low-level Guidance library, also a backend of vLLM and SGLang) compiles
the grammar and, for a parser state, computes the tokens that keep the text inside it (about
0.1 ms for SmolLM2's 49k-token vocabulary here). The target's row is masked (-inf) outside that
set before verification. A verify row's state is the committed output plus the draft tokens on
its path (a chain's first i, a tree node's ancestors and itself), each consumed from the
request's parser and rolled back after, so every row is masked exactly as plain decoding masks
that position: greedy output equals plain greedy decoding with the grammar, sampled tokens
follow the masked distribution. A row below a draft token the grammar refuses is never reached
(that token is masked at its parent's row, so the verifier rejects it) and stays unmasked.
"""

from __future__ import annotations

import functools
import json

import torch

from draftwise.errors import ConfigError
from draftwise.tree import path_mask


def json_object() -> str:
    """The grammar of any JSON object (OpenAI's response_format {"type": "json_object"})."""
    return json_schema({"type": "object"})


def json_schema(schema: dict | str) -> str:
    """The grammar of the JSON values a JSON schema allows (OpenAI's json_schema response
    format); a ConfigError naming the problem where the schema cannot be compiled."""
    from llguidance import LLMatcher

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise ConfigError(f"the JSON schema is not valid JSON: {error}") from None
    if not isinstance(schema, dict):
        raise ConfigError(f"a JSON schema is a JSON object, not {type(schema).__name__}.")
    return _checked(LLMatcher.grammar_from_json_schema(json.dumps(schema)), "JSON schema")


def regex(pattern: str) -> str:
    """The grammar of the strings a regular expression matches in whole."""
    from llguidance import LLMatcher

    return _checked(LLMatcher.grammar_from_regex(pattern), "regex")


def lark(source: str) -> str:
    """The grammar of a Lark grammar in llguidance's dialect (which may embed JSON schemas with
    `%json {...}` and refer to a special token as `<name>`)."""
    from llguidance import LLMatcher

    return _checked(LLMatcher.grammar_from_lark(source), "Lark grammar")


def _checked(grammar: str, what: str) -> str:
    from llguidance import LLMatcher

    problem = LLMatcher.validate_grammar(grammar)
    if problem and not problem.startswith("WARNING"):
        raise ConfigError(f"the {what} cannot be compiled: {problem}")
    return grammar


@functools.lru_cache(maxsize=4)  # per tokenizer: converting one takes ~0.7 s (SmolLM2's, here)
def _ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))


class Constraint:
    """One request's parser: masks verify rows, then consumes what was committed."""

    def __init__(self, grammar: str, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        from llguidance import LLMatcher

        self.matcher = LLMatcher(_ll_tokenizer(tokenizer, vocab_size, tuple(eos_token_ids)), grammar, log_level=0)
        if self.matcher.is_error():
            raise ConfigError(f"the grammar cannot be used with this model: {self.matcher.get_error()}")
        self.vocab_size = vocab_size

    @torch.inference_mode()  # the forward's logits are inference tensors, masked in place
    def mask(self, logits: torch.Tensor, draft_tokens: torch.Tensor, tree_mask: torch.Tensor | None) -> None:
        """Mask logits [rows, vocab] in place: row r to the tokens the grammar allows after the
        committed output and the draft tokens on r's path (tree_mask [1 + n, 1 + n] as the
        forward's, None for a chain)."""
        import llguidance.numpy as ln  # (its torch helpers compile a TorchScript kernel on import: deprecated)

        rows = logits.shape[0]
        bitmask = ln.allocate_token_bitmask(rows, self.vocab_size)  # all bits set: everything allowed
        drafted = draft_tokens.tolist()
        on_path = path_mask(rows, tree_mask)
        for row in range(rows):
            path = [drafted[node] for node in on_path[row].nonzero()[:, 0].tolist()]
            consumed = self.matcher.try_consume_tokens(path) if path else 0
            if consumed == len(path):
                ln.fill_next_token_bitmask(self.matcher, bitmask, row)
            # else a refused token on the path: the row is never reached, and keeps its bits set
            if consumed:
                self.matcher.rollback(consumed)
        bits = torch.from_numpy(bitmask)  # [rows, words]: bit b of word w allows token 32 w + b
        allowed = ((bits.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten(1)
        logits.masked_fill_(~allowed[:, :logits.shape[1]], float("-inf"))

    def forced(self, limit: int) -> list[int]:
        """The next tokens the grammar leaves no choice about (llguidance's fast-forward tokens:
        the only text that may follow, in the tokenizer's own tokenization), at most limit: a
        draft the target accepts unless it prefers another tokenization of that text."""
        return self.matcher.compute_ff_tokens()[:limit] if limit > 0 else []

    def allowed_prefix(self, draft_tokens: torch.Tensor) -> int:
        """How many of a chain draft's first tokens the grammar accepts after the committed output:
        the tokens past them would be rejected at the verify, so they need no row in it."""
        tokens = draft_tokens.tolist()
        accepted = self.matcher.try_consume_tokens(tokens) if tokens else 0
        if accepted:
            self.matcher.rollback(accepted)
        return accepted

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):  # only a token its own mask allowed reaches here
            raise AssertionError(f"the grammar refused committed token {token}: {self.matcher.get_error()}")
