"""`draftwise serve`: an OpenAI-compatible HTTP API over the continuous-batching scheduler.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics. Each request becomes a Sequence in the running batch (draftwise.scheduler);
streaming answers are server-sent events as OpenAI sends them, with usage (and its
`speculative` statistics) in one extra final chunk when stream_options.include_usage is set.
Errors use OpenAI's format, {"error": {"message", "type", "param", "code"}}: 400 for bad input,
401 for a wrong API key, 404 for another model, 413 for an oversize body, 429 when the queue is
full (with Retry-After), 408 when a request outlives the timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from draftwise.engine import Engine
from draftwise.errors import DraftwiseError
from draftwise.infill import infill_prompt
from draftwise.scheduler import DEFAULT_MAX_TOKENS, Event, QueueFull, Request, Scheduler
from draftwise.server.metrics import ServerMetrics
from draftwise.server.protocol import (ChatCompletionRequest, CompletionRequest, SamplingFields, TextOffsets,
                                       chat_logprobs, completion_logprobs, error_body, usage)
from draftwise.tools import ToolUse

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1


@dataclass(frozen=True, slots=True)
class ServerSettings:
    api_key: str | None = None  # every /v1 request must carry it as a Bearer token
    max_body_bytes: int = 1_000_000
    request_timeout_s: float = 600.0
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_tokens_limit: int | None = None  # the most output tokens a request may ask for (None: the context's room)
    # Of requests that name none. Coupled: a seeded request's text never depends on the batch.
    sampling_mode: str = "coupled"


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), self.status, headers=self.headers)


def create_app(engine: Engine, scheduler: Scheduler, settings: ServerSettings = ServerSettings(),
               metrics: ServerMetrics | None = None) -> FastAPI:
    """The HTTP app; the caller starts (and stops) the scheduler."""
    metrics = metrics or ServerMetrics()
    metrics.max_batch.set(scheduler.max_batch)
    served = engine.target.model.info.name
    loaded_at = int(time.time())  # /v1/models' `created`: when this server took the model up
    max_context = engine.target.model.info.max_context
    app = FastAPI(title="draftwise", version="0.1.0",
                  description="OpenAI-compatible API with lossless speculative decoding.")
    app.state.metrics = metrics
    app.state.scheduler = scheduler

    def on_step(report, requests) -> None:
        metrics.observe_step(report)
        metrics.batch_size.set(report.batch_size)
        metrics.queue_depth.set(scheduler.queue_depth)

    def on_finish(request: Request) -> None:
        if request.sequence.finish_reason == "cancelled":
            metrics.cancelled.inc()
        else:
            metrics.observe_finished(request.sequence.metrics)
        metrics.batch_size.set(scheduler.batch_size)
        metrics.queue_depth.set(scheduler.queue_depth)

    scheduler.on_step, scheduler.on_finish = on_step, on_finish

    @app.middleware("http")
    async def guard(request: HTTPRequest, call_next):
        """Auth and body size, before a body is read or validated; every answer is counted."""
        try:
            if request.url.path.startswith("/v1/"):
                _check_api_key(request, settings.api_key)
            if request.method == "POST":
                _check_body_size(request, settings.max_body_bytes)
            response = await call_next(request)
        except APIError as error:
            response = error.response()
        metrics.requests.labels(request.url.path if request.url.path in KNOWN_PATHS else "other",
                                str(response.status_code)).inc()
        return response

    @app.exception_handler(APIError)
    async def api_error(request: HTTPRequest, error: APIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: HTTPRequest, error: RequestValidationError):
        return _validation_error(error).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HTTPRequest, error: StarletteHTTPException):
        return APIError(error.status_code, str(error.detail), "invalid_request_error").response()

    @app.exception_handler(Exception)
    async def server_error(request: HTTPRequest, error: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(error).__name__}: {error}", "server_error").response()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": served, "activations": engine.target.activations,
                "kv_cache": engine.target.kv_cache, "batch_size": scheduler.batch_size,
                "queue_depth": scheduler.queue_depth, "max_batch": scheduler.max_batch}

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.batch_size.set(scheduler.batch_size)
        metrics.queue_depth.set(scheduler.queue_depth)
        metrics.prefix_cache_bytes.set(engine.prefix_cache.num_bytes if engine.prefix_cache is not None else 0)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served, "object": "model", "created": loaded_at, "owned_by": "draftwise"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: HTTPRequest):
        try:
            tool_use = body.tool_use(engine.tokenizer)
            prompt = body.chat()
        except DraftwiseError as error:
            param = "tools" if body.tools else "tool_choice" if body.tool_choice else "messages"
            raise APIError(400, str(error), param=param) from None
        return await _complete(body, prompt, "chat", request, tool_use)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: HTTPRequest):
        return await _complete(body, body.text(), "text", request)

    async def _complete(body: SamplingFields, prompt, kind: str, http_request: HTTPRequest,
                        tool_use: ToolUse | None = None):
        arrived = time.perf_counter()
        if body.model not in (None, "", served):
            raise APIError(404, f"model {body.model!r} is not served here; this server serves {served!r} (GET /v1/models).",
                           param="model", code="model_not_found")
        infill_stops: tuple[int, ...] = ()
        if kind == "chat" and not engine.tokenizer.chat_template:
            raise APIError(400, f"{served} has no chat template (a base model): send the text as a prompt to "
                           "/v1/completions instead.", param="messages")
        try:
            if kind == "text" and body.suffix:
                prompt_ids, infill_stops = infill_prompt(engine.tokenizer, prompt, body.suffix)
            else:
                prompt_ids = engine.encode(prompt, tool_use.tools if tool_use is not None else None)
        except DraftwiseError as error:
            raise APIError(400, str(error), param="suffix" if kind == "text" and body.suffix else
                           "messages" if kind == "chat" else "prompt") from None
        max_tokens = _max_tokens(body, len(prompt_ids), max_context, settings, kind)
        try:
            params = body.sampling_params(max_tokens, settings.sampling_mode, infill_stops)
            if tool_use is not None:
                params = replace(params, stop=params.stop + tool_use.stop, grammar=tool_use.grammar)
        except DraftwiseError as error:
            raise APIError(400, str(error)) from None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def on_event(event: Event) -> None:  # on the scheduler's thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop has closed (shutdown): nobody is listening
                pass

        try:
            job = scheduler.submit(Request(prompt_ids, params, on_event, body.num_draft_tokens()))
        except QueueFull as error:
            raise APIError(429, str(error), "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except DraftwiseError as error:
            raise APIError(503, str(error), "server_error") from None
        answer = Answer(kind, served, job, events, arrived, settings.request_timeout_s, metrics,
                        engine.tokenizer if params.logprobs is not None else None,
                        _echo(prompt, engine.tokenizer) if kind == "text" and body.echo else None, tool_use)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(answer.stream(scheduler, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            text, result = await answer.collect()
        finally:
            if not job.sequence or not job.sequence.finished:
                scheduler.cancel(job)
        return answer.final(text, result)

    return app


KNOWN_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


class Answer:
    """Turns a request's scheduler events into an OpenAI response, whole or streamed."""

    def __init__(self, kind: str, model: str, job: Request, events: asyncio.Queue, arrived: float, timeout_s: float,
                 metrics: ServerMetrics, tokenizer=None, echo: str | None = None, tool_use: ToolUse | None = None) -> None:
        """tokenizer: where the request asked for logprobs (their tokens' text), else None. echo:
        a completion's prompt, where the answer starts with it (and its tokens' logprobs).
        tool_use: a chat request's tools, whose calls are read out of the reply."""
        self.kind, self.model, self.job, self.events = kind, model, job, events
        self.tool_use = tool_use
        self.tokenizer = tokenizer
        self.echo = echo
        self.offsets = TextOffsets(tokenizer) if tokenizer is not None and kind == "text" else None
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.deadline = arrived + timeout_s
        self.timeout_s = timeout_s
        self.arrived = arrived
        self.last_token_at: float | None = None
        self.metrics = metrics

    async def next_event(self) -> Event:
        remaining = self.deadline - time.perf_counter()
        try:
            event = await asyncio.wait_for(self.events.get(), timeout=max(0.0, remaining))
        except asyncio.TimeoutError:
            raise APIError(408, f"the request did not finish within the server's timeout of {self.timeout_s:g} s: "
                                "lower max_tokens or retry when the server is less busy.",
                           "timeout_error", code="timeout") from None
        if event.error is not None:
            raise APIError(503 if not isinstance(event.error, DraftwiseError) else 400, str(event.error),
                           "server_error" if not isinstance(event.error, DraftwiseError) else "invalid_request_error")
        self._observe_latency(event)
        return event

    def _observe_latency(self, event: Event) -> None:
        now = time.perf_counter()
        if not event.delta:
            return
        if self.last_token_at is None:
            self.metrics.time_to_first_token.observe(now - self.arrived)
        elif event.num_tokens:
            gap = (now - self.last_token_at) / event.num_tokens
            for _ in range(min(event.num_tokens, 64)):
                self.metrics.inter_token_latency.observe(gap)
        self.last_token_at = now

    async def collect(self):
        pieces = []
        while True:
            event = await self.next_event()
            pieces.append(event.delta)
            if event.result is not None:
                return "".join(pieces), event.result

    def _logprobs(self, entries: list, token_ids: list[int] | None = None) -> dict | None:
        """A choice's `logprobs` for these tokens (None where the request asked for none);
        token_ids: where an entry may be None (an echoed prompt's first token)."""
        if self.tokenizer is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(entries, self.tokenizer)
        token_ids = [entry.token_id for entry in entries] if token_ids is None else token_ids
        return completion_logprobs(token_ids, entries, self.tokenizer, self.offsets)

    def _echoed_prompt(self) -> tuple[list[int], list]:
        """The prompt's token ids and logprobs, once it is prefilled (after the first event)."""
        seq = self.job.sequence
        return seq.prompt_ids, seq.prompt_logprobs or [None] * len(seq.prompt_ids)

    def final(self, text: str, result) -> dict:
        if self.echo is not None:
            ids, entries = self._echoed_prompt()
            generated = result.logprobs or []
            logprobs = self._logprobs(entries + generated, ids + [entry.token_id for entry in generated])
            text = self.echo + text
        else:
            logprobs = self._logprobs(result.logprobs or [])
        if self.kind == "chat":
            message, calls = {"role": "assistant", "content": text}, []
            if self.tool_use is not None:
                content, calls = self.tool_use.parse(text)
                message["content"] = content if content.strip() or not calls else None
                if calls:
                    message["tool_calls"] = [call.openai() for call in calls]
            choice = {"index": 0, "message": message, "logprobs": logprobs,
                      "finish_reason": _finish_reason(result.finish_reason, bool(calls))}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": result.finish_reason}
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice],
                "usage": usage(result.metrics)}

    def _chunk(self, delta: str | None, finish_reason: str | None = None, first: bool = False,
               logprobs: list | None = None, token_ids: list[int] | None = None, tool_calls: list | None = None) -> dict:
        """A streamed chunk; logprobs: those of the tokens committed since the previous chunk;
        tool_calls: the calls completed since then ({"index", "id", "type", "function"} each)."""
        lp = self._logprobs(logprobs, token_ids) if logprobs else None
        if self.kind == "chat":
            content = {"role": "assistant", "content": ""} if first else ({} if delta is None else {"content": delta})
            if tool_calls:
                content["tool_calls"] = tool_calls
            choice = {"index": 0, "delta": content, "logprobs": lp, "finish_reason": finish_reason}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": lp, "finish_reason": finish_reason}
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}

    async def stream(self, scheduler: Scheduler, include_usage: bool) -> AsyncIterator[str]:
        finished = False
        try:
            if self.kind == "chat":
                yield _sse(self._chunk(None, first=True))
            echoed = self.echo is None
            reader = self.tool_use.reader() if self.tool_use is not None else None
            num_calls = 0
            while True:
                try:
                    event = await self.next_event()
                except APIError as error:  # headers are sent: report in the stream, as OpenAI does
                    yield _sse(error_body(error.message, error.type, error.param, error.code))
                    break
                if not echoed:  # the prompt first, once it is prefilled (its logprobs are known)
                    echoed = True
                    ids, entries = self._echoed_prompt()
                    yield _sse(self._chunk(self.echo, logprobs=entries, token_ids=ids))
                delta, calls = event.delta, []
                if self.tool_use is not None:
                    delta, calls = reader.feed(event.delta)
                    if event.result is not None:
                        rest, more = reader.finish()
                        delta, calls = delta + rest, calls + more
                # an event's logprobs go out with its text, or where a tool call holds that text back,
                # alone; the last event's, without text, with the finish
                carries_logprobs = bool(delta or calls or event.logprobs and event.result is None)
                if carries_logprobs:
                    yield _sse(self._chunk(delta or None, logprobs=event.logprobs,
                                           tool_calls=[call.openai(num_calls + i) for i, call in enumerate(calls)]))
                num_calls += len(calls)
                if event.result is not None:
                    finished = True
                    yield _sse(self._chunk(None, _finish_reason(event.result.finish_reason, num_calls > 0),
                                           logprobs=None if carries_logprobs else event.logprobs))
                    if include_usage:
                        yield _sse({"id": self.id, "object": self._chunk(None)["object"], "created": self.created,
                                    "model": self.model, "choices": [], "usage": usage(event.result.metrics)})
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (or the request failed): free the slot now
                scheduler.cancel(self.job)


def _echo(prompt: str | list[int], tokenizer) -> str:
    """An echoed prompt's text: as sent, or its token ids' decoded text."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt, skip_special_tokens=True)


def _finish_reason(reason: str, made_calls: bool) -> str:
    """OpenAI's "tool_calls" where a reply that ended on its own made calls."""
    return "tool_calls" if made_calls and reason == "stop" else reason


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _max_tokens(body: SamplingFields, prompt_tokens: int, max_context: int, settings: ServerSettings, kind: str) -> int:
    requested = body.requested_max_tokens()
    room = max_context - prompt_tokens
    field = "max_completion_tokens" if kind == "chat" and getattr(body, "max_completion_tokens", None) else "max_tokens"
    limit = settings.max_tokens_limit
    if requested is None:
        if room < 1:
            raise APIError(400, f"the prompt has {prompt_tokens} tokens, the model's whole context of {max_context}: "
                                "shorten the prompt.", param="messages" if kind == "chat" else "prompt",
                           code="context_length_exceeded")
        return min(settings.default_max_tokens, room, limit or room)
    if limit is not None and requested > limit:
        raise APIError(400, f"{field}={requested} is above this server's limit of {limit} (--max-tokens-limit): "
                            f"ask for at most {limit}.", param=field, code="invalid_value")
    if prompt_tokens + requested > max_context:
        raise APIError(400, f"prompt ({prompt_tokens} tokens) + {field} ({requested}) = {prompt_tokens + requested} "
                            f"exceeds the model's context of {max_context} tokens: lower {field} or shorten the prompt.",
                       param=field, code="context_length_exceeded")
    return requested


def _check_api_key(request: HTTPRequest, api_key: str | None) -> None:
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or token.strip() != api_key:
        raise APIError(401, "missing or wrong API key: send the server's --api-key as 'Authorization: Bearer KEY'.",
                       "authentication_error", code="invalid_api_key")


def _check_body_size(request: HTTPRequest, max_bytes: int) -> None:
    length = request.headers.get("content-length")
    if length is None:
        if request.headers.get("transfer-encoding", "").lower() == "chunked":
            raise APIError(411, "send the body with a Content-Length header (chunked uploads are not accepted).")
        return
    if not length.isdigit() or int(length) > max_bytes:
        raise APIError(413, f"the request body is {length} bytes; this server accepts at most {max_bytes} "
                            "(--max-body-bytes).", code="body_too_large")


def _validation_error(error: RequestValidationError) -> APIError:
    """pydantic's first complaint, in OpenAI's words and format."""
    problems = error.errors()
    first = problems[0] if problems else {"loc": (), "msg": "invalid request", "type": ""}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
    return APIError(400, f"{param or 'body'}: {message}{more}", param=param, code="invalid_value")
