"""The single-request API: prefill, then propose -> one target forward -> verify -> commit/rollback,
each step being draftwise.step's batched step with a batch of one.

Plain decoding is the same loop with a drafter that never proposes, so the baseline and the
speculative path share every line that could make their outputs differ.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch

from draftwise.config import SamplingParams, with_sampling
from draftwise.controller import BatchController
from draftwise.draft_length import DraftLengthPolicy
from draftwise.drafters.base import Draft, Drafter, empty_draft
from draftwise.errors import ConfigError, PromptError
from draftwise.logprobs import TokenLogprob
from draftwise.metrics import RequestMetrics
from draftwise.models.loading import LoadedModel
from draftwise.prefix_cache import PrefixCache
from draftwise.sampling import make_generator
from draftwise.sequence import Sequence
from draftwise.step import run_step
from draftwise.structured import Constraint
from draftwise.text_stream import TextStream

Prompt = str | list[dict[str, str]] | list[int]  # raw text, chat messages [{"role": ..., "content": ...}], or token ids

# On AMX tiles a long prompt prefills in forwards of at most this many tokens: the products cost
# so little there that a whole long prompt's forward is bound by its own intermediate tensors
# (tens of MB each, fresh pages every forward). 2,048-token prompts, Intel Xeon with AMX, 2
# threads: SmolLM2 906 -> ~1,160-1,300 tok/s, Qwen2.5-Coder-1.5B 240 -> 274. With the other
# activations chunks of 512 measured 0.89-1.08x whole prompts, so they prefill whole. A chunk's
# rows compute as they would in one forward (batch invariance): the output is the same.
AMX_PREFILL_CHUNK = 512


@dataclass(slots=True)
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids; an EOS token that ended generation is not included
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    metrics: RequestMetrics
    # One per token of token_ids when SamplingParams.logprobs was set (draftwise.logprobs), else None.
    logprobs: list[TokenLogprob] | None = None
    # One per prompt token when SamplingParams.prompt_logprobs was set (None for the first), else None.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def to_dict(self) -> dict:
        out = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
               "metrics": self.metrics.to_dict()}
        if self.logprobs is not None:
            out["logprobs"] = [entry.to_dict() for entry in self.logprobs]
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = [entry and entry.to_dict() for entry in self.prompt_logprobs]
        return out


@dataclass(slots=True)
class StreamUpdate:
    delta: str  # text that became final since the previous update
    result: GenerationResult | None = None  # set on the last update only
    # With SamplingParams.logprobs: those of the tokens committed since the previous update (a
    # token's text may come an update later, while it is held back: an incomplete character or a
    # possible stop string). All updates' together are result.logprobs.
    logprobs: list[TokenLogprob] = field(default_factory=list)


class NoDrafter:
    """Plain decoding: every step proposes nothing, so each target forward commits one token."""

    sequential = False
    is_plain = True  # not even a grammar's forced tokens are drafted (draftwise.step)

    def begin(self, params: SamplingParams, generator: torch.Generator, max_length: int) -> None:
        pass

    def propose(self, context: torch.Tensor, num_draft_tokens: int) -> Draft:
        return empty_draft()

    def rollback(self, num_valid: int) -> None:
        pass  # nothing was proposed, so nothing to forget


class Engine:
    def __init__(self, target: LoadedModel, drafter: Drafter | None = None, num_draft_tokens: int = 5,
                 draft_length: DraftLengthPolicy | None = None) -> None:
        """num_draft_tokens is the most a step drafts; with a draft_length policy each step
        verifies the share of the draft that the policy expects to pay off (see
        draftwise.draft_length), without one it verifies every draft token."""
        self.target = target
        self.drafter: Drafter = drafter if drafter is not None else NoDrafter()
        self.num_draft_tokens = num_draft_tokens
        self.draft_length = draft_length
        # The batch's draft-length controller, on the policy's forward costs (draftwise.controller).
        self.controller = BatchController(draft_length.forward_s) if draft_length is not None else None
        # Layers whose hidden states the drafter reads (EAGLE, Medusa); () for most drafters.
        self.hidden_layers: tuple[int, ...] = tuple(getattr(self.drafter, "hidden_layers", ()))
        self.prefill_chunk = AMX_PREFILL_CHUNK if target.activations == "amx" else None
        self._prefix_cache: PrefixCache | None = None

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """Keys and values of finished requests that a later prompt starting the same way reuses
        (draftwise.prefix_cache; `draftwise chat` and `serve` set one); None: every prompt is
        prefilled. Setting one also lets a draft model keep its entries between requests."""
        return self._prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, cache: PrefixCache | None) -> None:
        self._prefix_cache = cache
        if hasattr(self.drafter, "keep_between_requests"):  # a draft model (drafters.draft_model, cross_vocab)
            self.drafter.keep_between_requests = cache is not None

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def encode(self, prompt: Prompt, tools: list[dict] | None = None) -> list[int]:
        """Token ids of a raw prompt, or of chat messages rendered by the model's chat template
        (with tools, OpenAI's function definitions, where given: draftwise.tools.ToolUse checks
        that the template shows them); token ids are taken as they are (checked against the
        vocabulary)."""
        if isinstance(prompt, (list, tuple)) and prompt and all(type(token) is int for token in prompt):
            outside = _outside_vocabulary("the prompt", prompt, self.target.model.info)
            if outside:
                raise PromptError(outside)
            return list(prompt)
        is_chat = isinstance(prompt, (list, tuple)) and all(isinstance(message, dict) for message in prompt)
        if not isinstance(prompt, str) and not is_chat:
            raise PromptError("a prompt is a string, a list of chat messages ({'role': ..., 'content': ...}) or a "
                              f"list of token ids, not {type(prompt).__name__} {str(prompt)[:40]!r}.")
        if isinstance(prompt, str):
            if not prompt.strip():
                raise PromptError("the prompt is empty: give some text to continue.")
            return list(self.tokenizer.encode(prompt))
        if not prompt or not any(isinstance(m.get("content"), str) and m["content"].strip() for m in prompt):
            raise PromptError("the chat has no message with content: add at least one message.")
        if not self.tokenizer.chat_template:
            raise PromptError(f"{self.target.model.info.name} has no chat template: pass a plain prompt instead.")
        from jinja2 import TemplateError

        try:
            rendered = self.tokenizer.apply_chat_template(prompt, tools=tools or None, add_generation_prompt=True,
                                                          tokenize=False)
        except TemplateError as error:  # e.g. a template that wants user and assistant turns to alternate
            raise PromptError(f"the chat template of {self.target.model.info.name} refused these messages: {error}") from None
        return list(self.tokenizer.encode(rendered, add_special_tokens=False))

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, **sampling) -> GenerationResult:
        """Generate for one prompt. Sampling settings come as params, or as its fields by name
        (engine.generate(prompt, max_new_tokens=64, temperature=0.7, seed=1)), or both: the names
        then override params' fields."""
        for update in self.stream(prompt, params, **sampling):
            if update.result is not None:
                return update.result
        raise AssertionError("stream() ended without a result")

    def generate_batch(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams] | None = None, *,
                       max_batch: int | None = None, progress: bool = False,
                       on_result: Callable[[int, GenerationResult], None] | None = None,
                       **sampling) -> list[GenerationResult]:
        """Generate for many prompts in one continuous batch (draftwise.batch): their results in
        the prompts' order, each greedy one token for token generate's for that prompt alone.
        params: one SamplingParams for all (its fields also by name, as generate's) or a list, one
        per prompt; max_batch: the most prompts decoded at once (None: from this machine's
        measured forward costs); progress: a progress bar on stderr; on_result(index, result):
        called as each prompt finishes, to keep a long job's answers as they come."""
        from draftwise.batch import generate_batch

        if params is None or isinstance(params, SamplingParams):
            params = with_sampling(params, sampling)
        elif sampling:
            params = [with_sampling(each, sampling) for each in params]
        return generate_batch(self, prompts, params, max_batch, progress, on_result)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, **sampling) -> Iterator[StreamUpdate]:
        """Generate, yielding text deltas as they become final; the last update has the result.
        Settings as generate's."""
        params = with_sampling(params, sampling)
        if self.draft_length is not None:
            self.draft_length.begin_request()
        seq = self.start(self.encode(prompt), params, self.drafter, self.draft_length)
        sent = 0  # logprobs already sent
        while not seq.finished:
            run_step(self.target.model, [seq], self.controller, self.hidden_layers, self.prefill_chunk)
            if seq.error is not None:  # its drafter, grammar... raised: the caller gets it as raised
                raise seq.error
            delta = "" if seq.finished else seq.text.delta()  # the final update carries the rest
            if delta:
                update = StreamUpdate(delta, logprobs=new_logprobs(seq, sent))
                sent += len(update.logprobs)
                yield update
        self.finish(seq)
        yield StreamUpdate(seq.text.delta(final=True), result_of(seq), new_logprobs(seq, sent))

    def start(self, prompt_ids: list[int], params: SamplingParams, drafter: Drafter,
              policy: DraftLengthPolicy | None, num_draft_tokens: int | None = None) -> Sequence:
        """A request's Sequence, ready for draftwise.step.run_step: its own cache, random
        stream and drafter state. num_draft_tokens: this request's draft ceiling (default the
        engine's; 0 decodes plainly)."""
        model = self.target.model
        max_context = model.info.max_context
        if not prompt_ids:  # e.g. a text of control characters the tokenizer drops
            raise PromptError(f"the prompt has no tokens for {model.info.name}'s tokenizer (it drops some "
                              "characters, such as control characters): give some text to continue.")
        if len(prompt_ids) >= max_context:
            raise PromptError(
                f"the prompt has {len(prompt_ids)} tokens but {model.info.name} reads at most "
                f"{max_context}: shorten the prompt."
            )
        for name, tokens in (("logit_bias", [token for token, _ in params.logit_bias]),
                             ("stop_token_ids", params.stop_token_ids)):
            outside = _outside_vocabulary(name, tokens, model.info)
            if outside:
                raise ConfigError(outside)
        num_draft_tokens = self.num_draft_tokens if num_draft_tokens is None else min(num_draft_tokens, self.num_draft_tokens)
        # The context never exceeds prompt + max_new_tokens; a verify forward holds k more.
        max_length = min(len(prompt_ids) + params.max_new_tokens, max_context)
        capacity = max_length + self.num_draft_tokens + 1
        if params.is_coupled and params.seed is None:  # the noise needs a seed: a fresh one per request
            params = replace(params, seed=secrets.randbits(63))
        generator = make_generator(params.seed)
        drafter.begin(params, generator, capacity)
        seq = Sequence(prompt_ids, params, drafter, policy, num_draft_tokens, generator, model.new_cache(capacity),
                       max_length, stop_tokens(model.info.eos_token_ids, params), TextStream(self.tokenizer, params.stop),
                       RequestMetrics(num_prompt_tokens=len(prompt_ids)))
        if params.grammar is not None:
            seq.constraint = Constraint(params.grammar, self.tokenizer, model.info.vocab_size, model.info.eos_token_ids)
        if self.prefix_cache is not None:
            seq.hidden_rows = [] if self.hidden_layers else None
            if seq.prompt_logprobs is None:  # scoring the prompt needs every row's logits: prefill it all
                self.prefix_cache.start(seq)
        return seq

    def finish(self, seq: Sequence) -> None:
        """A sequence is done: a complete one leaves its keys and values to the prefix cache."""
        if self.prefix_cache is not None and seq.finish_reason in ("stop", "length"):
            self.prefix_cache.keep(seq)


def _outside_vocabulary(name: str, tokens, info) -> str | None:
    """The message for the first of tokens outside the model's vocabulary (None if all are in it)."""
    outside = next((token for token in tokens if not 0 <= token < info.vocab_size), None)
    if outside is None:
        return None
    return (f"{name} names token {outside}, outside {info.name}'s vocabulary of {info.vocab_size}: give ids "
            f"from 0 to {info.vocab_size - 1}.")


def stop_tokens(eos_token_ids: tuple[int, ...], params: SamplingParams) -> frozenset[int]:
    """The tokens that end a request's output: the model's end-of-sequence tokens (unless
    ignore_eos) and its stop_token_ids."""
    return frozenset(() if params.ignore_eos else eos_token_ids) | frozenset(params.stop_token_ids)


def result_of(seq: Sequence) -> GenerationResult:
    if not seq.finished:
        raise AssertionError("the sequence has not finished")
    return GenerationResult(seq.text.text, seq.text.token_ids, seq.finish_reason, seq.metrics, seq.logprobs,
                            seq.prompt_logprobs)


def new_logprobs(seq: Sequence, sent: int) -> list[TokenLogprob]:
    """The sequence's logprobs after the first `sent` ([] where none are asked for)."""
    return seq.logprobs[sent:] if seq.logprobs is not None else []


