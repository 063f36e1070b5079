"""The OpenAI wire format: pydantic models of the requests draftwise serves and their answers.

Fields follow OpenAI's API reference; unknown fields are ignored as OpenAI does. Extensions:
top_k, min_p, repetition_penalty, stop_token_ids, min_tokens, ignore_eos and `speculative`
(per-request draft ceiling, or "off") in requests, and usage.speculative in answers (draft tokens proposed/accepted, acceptance rate, mean accepted
length, per-position acceptance), where OpenAI clients see it. Log-probabilities (chat's
logprobs + top_logprobs, completions' logprobs) are the model's (draftwise.logprobs): the same
numbers with speculation as without. response_format (json_object, json_schema) constrains the
output through draftwise.structured; tools, tool_choice and parallel_tool_calls go through
draftwise.tools (the history's tool_calls and tool messages to the chat template as it takes them).
"""

from __future__ import annotations

import codecs
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from draftwise import structured
from draftwise.config import SamplingParams
from draftwise.errors import ConfigError
from draftwise.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_bytes
from draftwise.metrics import RequestMetrics
from draftwise.tools import ToolUse

MAX_STOP_STRINGS = 16
# OpenAI request fields that change the answer and draftwise does not implement: accepted at
# their neutral values only, since ignoring e.g. frequency_penalty=1.0 would answer another
# request than the one sent (a 400 names the field instead). Unknown fields are still ignored.
NEUTRAL_ONLY = {
    "functions": (None, []), "function_call": (None, "none", "auto"), "best_of": (None, 1), "tools": (None, []),
}
INSTEAD = {"tools": "send them to /v1/chat/completions, where the model's chat template shows them",
           "functions": "send tools instead (functions is OpenAI's deprecated form of them)",
           "function_call": "send tool_choice instead (function_call is OpenAI's deprecated form of it)"}


def _neutral(name: str, value):
    if value not in NEUTRAL_ONLY[name]:
        instead = INSTEAD.get(name, "leave it unset; the output would otherwise not be what the request asks for")
        raise ValueError(f"{name} is not supported by draftwise (got {value!r}): {instead}")
    return value


class SpeculativeOptions(BaseModel):
    """Per-request speculation: num_draft_tokens caps the draft (0 = plain decoding)."""

    model_config = ConfigDict(extra="ignore")
    num_draft_tokens: int | None = Field(default=None, ge=0, le=256)


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict = Field(default_factory=dict, alias="schema")  # OpenAI's field name; "schema" shadows BaseModel's
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON a schema allows (draftwise.structured)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def grammar(self) -> str | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return structured.json_object()
        if self.json_schema is None:
            raise ConfigError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}.')
        return structured.json_schema(self.json_schema.json_schema or {})


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)  # an extension, as vLLM's
    min_tokens: int = Field(default=0, ge=0)  # extensions, as vLLM's: no end-of-sequence before this many
    ignore_eos: bool = False  # ... and none at all (stop_token_ids still stop)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)  # an extension, as vLLM's
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    speculative: SpeculativeOptions | Literal["off"] | None = None
    # "coupled": the text depends on the seed alone, never on the batch or the drafts
    # (draftwise.sampling); "rejection": rejection sampling. None: the server's default.
    sampling_mode: Literal["rejection", "coupled"] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("n > 1 is not supported: send n separate requests (each may carry its own seed)")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        strings = [stop] if isinstance(stop, str) else list(stop or [])
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        if any(not s for s in strings):
            raise ValueError("stop strings must be non-empty")
        return stop

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def token_biases(self) -> tuple[tuple[int, float], ...]:
        """logit_bias with its keys (token ids as strings, as OpenAI sends them) as integers."""
        biases = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise ConfigError(f"logit_bias key {key!r} is not a token id: keys are token ids, e.g. \"50256\".")
            biases.append((int(key), bias))
        return tuple(sorted(biases))

    def num_logprobs(self) -> int | None:
        """How many alternatives each token's logprobs lists (None: no logprobs)."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        """The same for the prompt's tokens (completions' echo)."""
        return None

    def num_draft_tokens(self) -> int | None:
        """This request's draft ceiling: None = the server's, 0 = off."""
        if self.speculative == "off":
            return 0
        return None if self.speculative is None else self.speculative.num_draft_tokens

    def sampling_params(self, max_new_tokens: int, default_mode: str,
                        extra_stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              seed=self.seed, max_new_tokens=max_new_tokens, stop=stop,
                              stop_token_ids=tuple(self.stop_token_ids or ()) + extra_stop_token_ids,
                              min_new_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                              sampling_mode=self.sampling_mode or default_mode, logprobs=self.num_logprobs(),
                              presence_penalty=self.presence_penalty or 0.0,
                              frequency_penalty=self.frequency_penalty or 0.0,
                              repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                              logit_bias=self.token_biases(),
                              grammar=self.response_format.grammar() if self.response_format is not None else None,
                              prompt_logprobs=self.num_prompt_logprobs())


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str = "{}"  # a JSON object, as text


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made (the history of a conversation with tools)."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # OpenAI's rule for names
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    name: str | None = None

    def template_message(self, index: int) -> dict:
        """This message as chat templates take it ("developer" is OpenAI's newer name for
        "system"; a call's arguments as an object, which templates write out as JSON)."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments, index, i)}}
                for i, call in enumerate(self.tool_calls)]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list | None = None
    function_call: str | dict | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @field_validator("functions", "function_call")
    @classmethod
    def _only_neutral(cls, value, info):
        return _neutral(info.field_name, value)

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat(self) -> list[dict]:
        return [message.template_message(index) for index, message in enumerate(self.messages)]

    def tool_use(self, tokenizer) -> ToolUse | None:
        """The request's tools as draftwise.tools reads them (None: no tools, or tool_choice
        "none", which keeps them out of the prompt and the reply)."""
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        if not self.tools:
            if choice not in (None, "none", "auto"):
                raise ConfigError(f"tool_choice {choice!r} needs tools: send the functions it may call in tools.")
            return None
        use = ToolUse(tokenizer, [tool.model_dump(exclude_none=True) for tool in self.tools], choice or "auto",
                      self.parallel_tool_calls)
        if use.active and self.response_format is not None and self.response_format.type != "text":
            raise ConfigError("response_format with tools is not supported yet: send one of them (tool_choice "
                              '"none" keeps the tools out of it).')
        return use if use.active else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]  # one prompt: text, or token ids
    # logprobs=n: each token's log-probability and the n most probable tokens at its position
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # echo: the answer's text (and logprobs) start with the prompt's; with max_tokens=0 it scores
    # the prompt and generates nothing (what evaluation harnesses send for log-likelihoods).
    echo: bool = False
    max_tokens: int | None = Field(default=None, ge=0)
    best_of: int | None = None
    tools: list | None = None  # chat's: refused here, rather than ignored
    # fill-in-the-middle: the prompt is the code before, suffix the code after (draftwise.infill)
    suffix: str | None = None

    @field_validator("best_of", "tools")
    @classmethod
    def _only_neutral_here(cls, value, info):  # another name: the same one would replace the fields' above
        return _neutral(info.field_name, value)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and not (prompt and isinstance(prompt[0], int)) and len(prompt) != 1:
            raise ValueError("send one prompt per request (a list of exactly one string, or of one list of token "
                             "ids, is accepted)")
        return prompt

    @model_validator(mode="after")
    def _zero_tokens_only_with_echo(self):
        if self.suffix and (self.echo or not isinstance(self.text(), str)):
            raise ValueError("suffix (fill-in-the-middle) takes a text prompt, without echo")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 generates nothing: ask for at least 1 token, or send echo: true (with "
                             "logprobs) to score the prompt")
        return self

    def text(self) -> str | list[int]:
        """The prompt: its text, or its token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return self.prompt
        return self.prompt[0]

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        if not self.echo:
            return None
        return self.logprobs if self.logprobs is not None else 0 if self.max_tokens == 0 else None


def usage(metrics: RequestMetrics) -> dict:
    """OpenAI's usage object plus draftwise's speculation statistics."""
    return {
        "prompt_tokens": metrics.num_prompt_tokens,
        "completion_tokens": metrics.num_generated_tokens,
        "total_tokens": metrics.num_prompt_tokens + metrics.num_generated_tokens,
        "prompt_tokens_details": {"cached_tokens": metrics.num_cached_prompt_tokens},  # from the prefix cache
        "speculative": {
            "draft_tokens": metrics.num_draft_tokens,
            "accepted_tokens": metrics.num_accepted_tokens,
            "acceptance_rate": round(metrics.acceptance_rate, 4),
            "mean_accepted_length": round(metrics.mean_accepted_length, 4),
            "per_position_acceptance": [round(rate, 4) for rate in metrics.per_position_acceptance],
            "target_forwards": metrics.num_target_forwards,
            "forced_tokens": metrics.num_forced_tokens,  # drafted because the grammar forced them
        },
    }


def chat_logprobs(entries: list[TokenLogprob], tokenizer) -> dict:
    """A chat choice's (or chunk's) `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def item(token_id: int, logprob: float) -> dict:
        raw = token_bytes(tokenizer, token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**item(entry.token_id, entry.logprob), "top_logprobs": [item(*top) for top in entry.top]}
                        for entry in entries], "refusal": None}


class TextOffsets:
    """Where each token of a completion starts in its text, in characters (completions'
    `text_offset`), fed token by token: its bytes through an incremental UTF-8 decoder, so a
    character split between tokens counts once, when complete. Special tokens add no text (the
    text skips them)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.special = set(tokenizer.all_special_ids)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.offset = 0

    def next(self, token_id: int) -> int:
        """This token's offset; then move past it."""
        start = self.offset
        if token_id not in self.special:
            self.offset += len(self.decoder.decode(token_bytes(self.tokenizer, token_id)))
        return start


def completion_logprobs(token_ids: list[int], entries: list[TokenLogprob | None], tokenizer,
                        offsets: TextOffsets) -> dict:
    """A completion choice's (or chunk's) `logprobs` for these tokens: tokens, token_logprobs,
    top_logprobs (the most probable tokens' text -> logprob, with the chosen token's always among
    them, as OpenAI does) and text_offset. An entry is None for an echoed prompt's first token,
    which nothing predicts (null there, as OpenAI answers)."""
    def text(token_id: int) -> str:
        return token_bytes(tokenizer, token_id).decode("utf-8", errors="replace")

    tops = []
    for token_id, entry in zip(token_ids, entries):
        top = None
        if entry is not None:
            top = {text(alternative): logprob for alternative, logprob in entry.top}
            top.setdefault(text(token_id), entry.logprob)
        tops.append(top)
    return {"tokens": [text(token_id) for token_id in token_ids],
            "token_logprobs": [entry and entry.logprob for entry in entries],
            "top_logprobs": tops, "text_offset": [offsets.next(token_id) for token_id in token_ids]}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error format."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _arguments(text: str, message: int, call: int) -> dict:
    """An earlier call's arguments (JSON text, as OpenAI sends them) as the object they encode."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ConfigError(f"messages[{message}].tool_calls[{call}].function.arguments is not a JSON object "
                          f"({text[:60]!r}): send the arguments the call was made with, as JSON text.")
    return value
