"""`draftwise batch`: an OpenAI Batch API input file, answered on this machine.

Each input line is one request as OpenAI's Batch API takes it, {"custom_id", "method": "POST",
"url": "/v1/chat/completions" or "/v1/completions", "body": {...}}, or a bare body: a line with
"messages" goes to chat completions, one with "prompt" to completions, its custom_id "line-N".
Every request goes through `draftwise serve`'s own routes (server/app.py), in this process and
without a port (httpx's ASGI transport): the same validation, defaults, tool calls, response
formats, log-probabilities and usage.speculative as the server's answers. All of them decode in
one continuous batch (draftwise.scheduler) on the calling thread, as `draftwise serve` runs it.

Each answer is appended to the output as soon as it finishes, one line in OpenAI's batch output
format: {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}; a
request the server refuses (a 400 for a bad field, say) has its status and OpenAI error body
there and the others go on. Run the same command again after an interruption: the answers
already written with status 200 are kept and their requests skipped.

A body's "model" is not checked (the file runs on --model; the answers name it) and "stream" is
dropped (a batch answer is whole).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from draftwise.errors import ConfigError, DraftwiseError
from draftwise.scheduler import DEFAULT_PREFILL_CHUNK, Scheduler
from draftwise.server.app import ServerSettings, create_app

ROUTES = ("/v1/chat/completions", "/v1/completions")
# A batch request waits in the queue behind others for as long as the file takes: no timeout.
NO_TIMEOUT_S = 10.0**7


@dataclass(frozen=True, slots=True)
class BatchRequest:
    custom_id: str
    url: str  # one of ROUTES
    body: dict


@dataclass(slots=True)
class BatchSummary:
    num_requests: int = 0  # in the input
    num_skipped: int = 0  # answered by an earlier run
    num_completion_tokens: int = 0
    num_target_forwards: int = 0
    seconds: float = 0.0
    statuses: dict[int, int] = field(default_factory=dict)  # this run's answers by HTTP status

    @property
    def num_answered(self) -> int:  # status 200 this run
        return self.statuses.get(200, 0)

    @property
    def num_refused(self) -> int:  # another status this run (its error body is in the output)
        return sum(count for status, count in self.statuses.items() if status != 200)

    def line(self) -> str:
        rate = self.num_completion_tokens / self.seconds if self.seconds else 0.0
        per_forward = self.num_completion_tokens / self.num_target_forwards if self.num_target_forwards else 0.0
        refused = ""
        if self.num_refused:
            codes = ", ".join(f"{count} x {status}" for status, count in sorted(self.statuses.items()) if status != 200)
            refused = f", {self.num_refused} refused ({codes}: their error bodies are in the output)"
        skipped = f", {self.num_skipped} already answered" if self.num_skipped else ""
        counts = f"{self.num_requests} requests: {self.num_answered} answered{refused}{skipped}"
        if not self.num_answered:
            return counts
        return (f"{counts} | {self.num_completion_tokens} tokens in {self.seconds:.1f} s ({rate:.1f} tok/s) | "
                f"{per_forward:.2f} tokens/forward")


def read_requests(path: Path) -> list[BatchRequest]:
    """The input file's requests, every line checked before any model loads."""
    if not path.is_file():
        raise ConfigError(f"batch input {path} does not exist: give a JSONL file, one request a line.")
    requests, seen = [], set()
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{where} is not JSON ({error.msg} at character {error.pos + 1}): one JSON object a line.") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{where} is a JSON {type(record).__name__}, not an object: give a request "
                                  '({"custom_id", "method", "url", "body"}) or a body ({"messages": ...} or {"prompt": ...}).')
            request = _request(record, number, where)
            if request.custom_id in seen:
                raise ConfigError(f"{where}: custom_id {request.custom_id!r} appears twice; each request needs its own.")
            seen.add(request.custom_id)
            requests.append(request)
    if not requests:
        raise ConfigError(f"batch input {path} holds no requests: one JSON object a line.")
    return requests


def _request(record: dict, number: int, where: str) -> BatchRequest:
    if "body" not in record:  # a bare body
        if "messages" in record:
            url = ROUTES[0]
        elif "prompt" in record:
            url = ROUTES[1]
        else:
            raise ConfigError(f'{where} has no "body", "messages" or "prompt": give an OpenAI batch request or a body.')
        return BatchRequest(str(record.get("custom_id", f"line-{number}")), url,
                            {key: value for key, value in record.items() if key != "custom_id"})
    body, url = record["body"], record.get("url")
    if not isinstance(body, dict):
        raise ConfigError(f'{where}: "body" must be a JSON object (the request body), not {type(body).__name__}.')
    if url not in ROUTES:
        raise ConfigError(f'{where}: url {url!r} is not served here: give one of {", ".join(ROUTES)}.')
    if record.get("method", "POST") != "POST":
        raise ConfigError(f'{where}: method {record["method"]!r}: batch requests are POSTs.')
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ConfigError(f'{where}: an OpenAI batch request needs a "custom_id" string, to find its answer by.')
    return BatchRequest(custom_id, url, body)


def earlier_answers(output: Path) -> list[tuple[str, str]]:
    """(custom_id, line) of each answer with status 200 in an earlier run's output ([] where
    there is none), checked before any model loads: a file whose lines are not batch answers is
    refused rather than rewritten (a mistyped --out must not lose someone's file). A last line
    cut short by a kill is dropped."""
    if not output.exists():
        return []
    if not output.is_file():
        raise ConfigError(f"--out {output} is not a file: name a file for the answers.")
    lines = output.read_text(encoding="utf-8").splitlines()
    answers = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue  # the line a kill cut short
            record = None
        if not isinstance(record, dict) or "custom_id" not in record or "response" not in record:
            raise ConfigError(f"--out {output} already holds something other than batch answers (line {number}): "
                              "give a new file, or the output of an earlier `draftwise batch` run to resume it.")
        if (record["response"] or {}).get("status_code") == 200:
            answers.append((record["custom_id"], line + "\n"))
    return answers


def keep_answered(output: Path) -> set[str]:
    """The custom_ids already answered (status 200) in an earlier run's output, which is rewritten
    to hold those lines alone: a refused request is tried again."""
    if not output.exists():
        return set()
    answers = earlier_answers(output)
    partial = output.with_name(output.name + ".partial")
    partial.write_text("".join(line for _, line in answers), encoding="utf-8")
    os.replace(partial, output)
    return {custom_id for custom_id, _ in answers}


def run_batch(engine, requests: list[BatchRequest], output: Path, max_batch: int,
              settings: ServerSettings = ServerSettings(), prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
              progress: bool = True) -> BatchSummary:
    """Answer every request not yet answered in output (keep_answered), appending each answer as
    it finishes; the scheduler runs on this thread, the requests' HTTP side on another."""
    import httpx
    from tqdm.auto import tqdm

    summary = BatchSummary(num_requests=len(requests))
    answered = keep_answered(output)
    todo = [request for request in requests if request.custom_id not in answered]
    summary.num_skipped = len(requests) - len(todo)
    if not todo:
        return summary
    settings = replace(settings, request_timeout_s=NO_TIMEOUT_S)
    # Twice the batch in flight: the scheduler's queue always holds the next requests.
    in_flight = 2 * max_batch
    scheduler = Scheduler(engine, max_batch, max_queue=in_flight, prefill_chunk=prefill_chunk)
    app = create_app(engine, scheduler, settings)
    served = engine.target.model.info.name
    bar = tqdm(total=len(todo), unit="request", desc="draftwise batch", disable=not progress)
    started = time.perf_counter()
    failure: list[BaseException] = []

    async def answer(client, request: BatchRequest, limit: asyncio.Semaphore, sink) -> None:
        async with limit:
            body = {**request.body, "model": served}
            body.pop("stream", None)
            body.pop("stream_options", None)
            response = await client.post(request.url, json=body)
        payload = response.json()
        line = {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": request.custom_id,
                "response": {"status_code": response.status_code, "request_id": payload.get("id", ""), "body": payload},
                "error": None}
        sink.write(json.dumps(line) + "\n")
        sink.flush()
        summary.statuses[response.status_code] = summary.statuses.get(response.status_code, 0) + 1
        if response.status_code == 200:
            usage = payload.get("usage") or {}
            summary.num_completion_tokens += usage.get("completion_tokens", 0)
            summary.num_target_forwards += (usage.get("speculative") or {}).get("target_forwards", 0)
        rate = summary.num_completion_tokens / (time.perf_counter() - started)
        bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
        bar.update(1)

    async def answer_all() -> None:
        limit = asyncio.Semaphore(in_flight)
        transport = httpx.ASGITransport(app=app)
        with output.open("a", encoding="utf-8") as sink:
            async with httpx.AsyncClient(transport=transport, base_url="http://draftwise-batch",
                                         timeout=None) as client:
                await asyncio.gather(*(answer(client, request, limit, sink) for request in todo))

    def http_side() -> None:
        try:
            asyncio.run(answer_all())
        except BaseException as error:  # handed to the main thread, which raises it
            failure.append(error)
        finally:
            scheduler.stop()

    thread = threading.Thread(target=http_side, name="draftwise-batch-http", daemon=True)
    thread.start()
    try:
        scheduler.run()  # until http_side stops it: every request answered (or a failure)
    except KeyboardInterrupt:  # what is written stays; the requests in flight go with this process
        bar.close()
        raise BatchInterrupted(f"interrupted: {summary.num_answered + summary.num_refused} of {len(todo)} answers "
                               f"written to {output}; run the same command again to answer the rest.") from None
    thread.join(timeout=30)
    bar.close()
    summary.seconds = time.perf_counter() - started
    if failure:
        raise failure[0]
    return summary


class BatchInterrupted(DraftwiseError):
    """Ctrl-C during a batch: the answers written so far are kept."""


def print_summary(summary: BatchSummary, output: Path) -> None:
    print(f"draftwise batch: {summary.line()} -> {output}", file=sys.stderr)
