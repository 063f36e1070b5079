"""Frozen, validated settings. Each field maps one-to-one to a kebab-case CLI flag."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from draftwise.errors import ConfigError
from draftwise.logprobs import MAX_TOP_LOGPROBS


SAMPLING_MODES = ("rejection", "coupled")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How tokens are chosen from the TARGET's distribution.

    temperature == 0 means greedy decoding. top_k == 0, top_p == 1 and min_p == 0 disable
    those filters. The filters are applied to the target's distribution (and the drafter's,
    when it samples), so speculation never changes what is sampled.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 128
    # The output's end-of-sequence and stop_token_ids are banned (logit -inf) before this many
    # tokens; stop strings still apply (as vLLM's min_tokens).
    min_new_tokens: int = 0
    # Generate through end-of-sequence tokens as through any other (stop_token_ids still stop):
    # fixed-length outputs for measurements.
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    # Token ids that end the output as the model's end-of-sequence tokens do (not included in it).
    stop_token_ids: tuple[int, ...] = ()
    # "coupled" (default): token t is argmax(log p_t + Gumbel noise keyed by (seed, t)), so the
    # text depends on the seed alone, whatever the drafter, the draft lengths or the batch
    # (draftwise.sampling). "rejection": rejection sampling (Leviathan et al.), whose text
    # depends on the draft lengths. Measured side by side, they accept about as many draft
    # tokens (README, "Same seed, same text").
    sampling_mode: str = "coupled"
    # None: no log-probabilities; n >= 0: each generated token's log-probability under the
    # model, and the n most probable tokens at its position (draftwise.logprobs; at most 20).
    logprobs: int | None = None
    # The same for the PROMPT's tokens, each given the ones before it (the first has none):
    # scoring a text. With it, max_new_tokens=0 scores the prompt and generates nothing.
    prompt_logprobs: int | None = None
    # Penalties on tokens already seen (draftwise.penalties; lossless under speculation):
    # presence and frequency over the output, as OpenAI's; repetition over prompt and output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Added to those tokens' logits at every position, (token id, bias) pairs; a dict is taken too.
    # -100 all but bans a token, 100 all but forces it (OpenAI's range).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The output stays inside this grammar (draftwise.structured: json_object(), json_schema(...),
    # regex(...)); None: any text.
    grammar: str | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ConfigError(
                f"temperature={self.temperature} is invalid: use 0 for greedy decoding "
                "or a positive value (e.g. 0.7) for sampling."
            )
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k} is invalid: use 0 to disable it or a positive count.")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p={self.top_p} is invalid: it must be in (0, 1]; 1 disables it.")
        if not 0.0 <= self.min_p < 1.0:
            raise ConfigError(f"min_p={self.min_p} is invalid: it must be in [0, 1); 0 disables it.")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ConfigError(f"seed={self.seed} is invalid: it must fit in 64 bits (-2**63 .. 2**64 - 1).")
        if self.max_new_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} is invalid: it must be at least 1 (0 only scores "
                              "a prompt: with prompt_logprobs set).")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ConfigError(f"min_new_tokens={self.min_new_tokens} is invalid: it must be in [0, max_new_tokens "
                              f"= {self.max_new_tokens}].")
        if self.sampling_mode not in SAMPLING_MODES:
            raise ConfigError(f"sampling_mode={self.sampling_mode!r} is invalid: use one of {', '.join(SAMPLING_MODES)}.")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(f"{name}={getattr(self, name)} is invalid: it must be in [-2, 2] (OpenAI's range); "
                                  "0 disables it.")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ConfigError(f"repetition_penalty={self.repetition_penalty} is invalid: it must be positive; 1 disables "
                              "it, above 1 (e.g. 1.1) discourages repeating.")
        if not isinstance(self.stop_token_ids, tuple):  # a list or set is taken too
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not isinstance(token, int) or token < 0 for token in self.stop_token_ids):
            raise ConfigError(f"stop_token_ids={self.stop_token_ids} is invalid: give token ids (non-negative integers).")
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            raise ConfigError("logit_bias names a token twice: give each token id one bias.")
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or token < 0:
                raise ConfigError(f"logit_bias has token {token!r}: keys are token ids (non-negative integers).")
            if not -100.0 <= bias <= 100.0:
                raise ConfigError(f"logit_bias[{token}]={bias} is invalid: biases are in [-100, 100].")
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(self, name)
            if count is not None and not 0 <= count <= MAX_TOP_LOGPROBS:
                raise ConfigError(f"{name}={count} is invalid: give 0 (each token's own log-probability) up to "
                                  f"{MAX_TOP_LOGPROBS} (also that many most probable alternatives), or None for none.")
        if isinstance(self.stop, str):  # a lone string would be iterated character by character
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty; remove the empty string from stop.")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether the verifier judges by adjusted logits (draftwise.penalties): a bias, a penalty or
        a minimum length."""
        return bool(self.logit_bias) or self.has_penalties or self.min_new_tokens > 0

    @property
    def is_coupled(self) -> bool:
        """Sampling whose text is a function of (seed, prompt) only (sampling_mode="coupled")."""
        return self.sampling_mode == "coupled" and not self.is_greedy


def with_sampling(params: SamplingParams | None, fields: dict) -> SamplingParams:
    """params (default: SamplingParams()) with the given fields set by name, validated as ever;
    an unknown name is a ConfigError that lists the valid ones."""
    names = [field.name for field in dataclasses.fields(SamplingParams)]
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise ConfigError(f"unknown sampling setting {', '.join(map(repr, unknown))}: use {', '.join(names)} "
                          "(or pass a SamplingParams).")
    return dataclasses.replace(params or SamplingParams(), **fields) if fields else params or SamplingParams()


# Most draft tokens per step, per drafter, when not given. With the adaptive draft length
# (the default) this is a ceiling: the policy verifies fewer when they would not pay off.
# n-gram drafts cost nothing to make, and copied spans run long (RAG answers, code edits), so
# its ceiling is high; a draft model pays a forward per token, so its ceiling is lower.
# A head's tree is a ceiling of nodes: the policy keeps as many as the measured costs pay for.
DEFAULT_NUM_DRAFT_TOKENS = {"ngram": 10, "model": 5, "cross-vocab": 5, "eagle": 24, "medusa": 24, "history": 24}
FALLBACK_NUM_DRAFT_TOKENS = 5
# --drafter history's window: the latest answer tokens it counts, about 200 bytes each (40 MB)
DEFAULT_HISTORY_TOKENS = 200_000
DRAFT_LENGTHS = ("adaptive", "fixed")
CROSS_VOCAB_METHODS = ("auto", "string", "intersection")  # see draftwise.drafters.cross_vocab
# How a draft model's weights are stored. A draft's precision never changes the output (every
# draft token is verified by the target), only how often it is right and how fast it drafts:
# "auto" is int8 where the native decoder runs the draft (a 135M draft: 36 -> 21 ms a token
# here), and its own dtype where transformers does.
DRAFT_QUANTIZATIONS = ("auto", "none", "int8", "int4")


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """How speculation is run: which drafter, how many tokens it may propose per step, and
    whether each step verifies all of them ("fixed") or the share that pays off ("adaptive")."""

    drafter: str = "ngram"
    num_draft_tokens: int | None = None  # None: DEFAULT_NUM_DRAFT_TOKENS for the drafter
    draft_model: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    draft_length: str = "adaptive"
    cross_vocab_method: str = "auto"
    draft_quantize: str = "auto"
    head: str | None = None  # --drafter eagle / medusa: a folder written by `draftwise train` (None: the shipped one)
    # --drafter history: how many of the engine's latest answer tokens it drafts from (None: DEFAULT_HISTORY_TOKENS)
    history_tokens: int | None = None
    history_file: str | None = None  # --drafter history: where its history is kept between processes

    @property
    def max_draft_tokens(self) -> int:
        if self.num_draft_tokens is not None:
            return self.num_draft_tokens
        return DEFAULT_NUM_DRAFT_TOKENS.get(self.drafter, FALLBACK_NUM_DRAFT_TOKENS)

    def __post_init__(self) -> None:
        if self.draft_length not in DRAFT_LENGTHS:
            raise ConfigError(f"draft_length={self.draft_length!r} is invalid: use one of {', '.join(DRAFT_LENGTHS)}.")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 1:
            raise ConfigError(
                f"num_draft_tokens={self.num_draft_tokens} is invalid: it must be at least 1 "
                "(use drafter='none' for plain decoding)."
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(
                f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max} are invalid: "
                "need 1 <= ngram_min <= ngram_max."
            )
        if self.drafter in ("model", "cross-vocab") and not self.draft_model:
            raise ConfigError(f"drafter={self.drafter!r} needs a draft model: pass --draft-model NAME|PATH.")
        if self.head is not None and self.drafter not in ("eagle", "medusa"):
            raise ConfigError(f"head={self.head!r} is only read by drafter='eagle' or 'medusa', not {self.drafter!r}.")
        if self.history_tokens is not None:
            if self.drafter != "history":
                raise ConfigError(f"history_tokens={self.history_tokens} is only read by drafter='history', "
                                  f"not {self.drafter!r}.")
            if self.history_tokens < 0:
                raise ConfigError(f"history_tokens={self.history_tokens} is invalid: use 0 (draft from this request "
                                  "alone) or more.")
        if self.history_file is not None and self.drafter != "history":
            raise ConfigError(f"history_file={self.history_file!r} is only read by drafter='history', "
                              f"not {self.drafter!r}.")
        if self.draft_quantize not in DRAFT_QUANTIZATIONS:
            raise ConfigError(
                f"draft_quantize={self.draft_quantize!r} is invalid: use one of {', '.join(DRAFT_QUANTIZATIONS)}."
            )
        if self.cross_vocab_method not in CROSS_VOCAB_METHODS:
            raise ConfigError(
                f"cross_vocab_method={self.cross_vocab_method!r} is invalid: use one of {', '.join(CROSS_VOCAB_METHODS)}."
            )
