"""Serving under load: aggregate tokens/s and inter-token latency at 1, 4 and 16 concurrent
streaming clients, for `draftwise serve` (plain batched decoding, batched with the draft-length
controller, batched with a FIXED draft length) and llama.cpp's OpenAI server
(llama-cpp-python's `llama_cpp.server`) on the same GGUF file, all in one run.

    python benchmarks/serve_load.py --model smollm2-135m
    python benchmarks/serve_load.py --model qwen2.5-coder-1.5b --requests-per-client 1 --max-tokens 64
    python benchmarks/serve_load.py --model qwen2.5-coder-1.5b --requests-per-client 1 --max-tokens 64 \
        --configs "plain batched,batched + controller" --draftwise-flags "--activations int8"

Each server runs in its own process (2 CPU threads, as the machine has), started and stopped
here; every client sends the bench suite's prompts (benchmarks/prompts, rendered by the model's
chat template into one text prompt so every server reads the same tokens) through
/v1/completions, streaming, greedy. Client c sends prompts c*R .. c*R+R-1 of the suite one
after another; the load level's wall time runs from the first request to the last answer.

- aggregate tok/s: completion tokens (the servers' usage) / wall time;
- inter-token latency: each stream chunk's gap since the previous one, spread over the tokens
  it carries (re-tokenised), p50 / p99 over all tokens of the level;
- TTFT: mean time to the first text.

The warm-up request uses the suite's last prompt, which no level sends (with 1, 4 and 16
clients and up to 2 requests each, levels use the first 32). llama.cpp's server reuses the
keys and values of prompts it has seen, so it is restarted before each level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CONFIGS = {
    # name -> draftwise serve flags (None: llama.cpp)
    "plain batched": ["--drafter", "none"],
    "batched + controller": ["--drafter", "ngram", "--draft-length", "adaptive"],
    "batched fixed k=10": ["--drafter", "ngram", "--draft-length", "fixed", "--num-draft-tokens", "10"],
    "llama.cpp server": None,
}


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    process.wait(timeout=30)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(name: str, flags: list[str] | None, model: str, max_batch: int, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if flags is None:
        from draftwise.models import registry

        command = [sys.executable, "-m", "llama_cpp.server", "--model", str(registry.gguf_path(model)),
                   "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "8192",
                   "--port", str(port), "--model_alias", model,
                   "--interrupt_requests", "False"]  # its default drops a running stream when another request arrives
    else:
        command = [sys.executable, "-m", "draftwise.cli", "serve", "--model", model, "--port", str(port), "--quiet",
                   "--max-batch", str(max_batch), "--max-queue", "256", "--threads", str(threads), *flags]
    log = tempfile.NamedTemporaryFile("w+", prefix="serve-load-", suffix=".log", delete=False)  # a pipe would fill
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited: {Path(log.name).read_text()[-2000:]}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start")
        time.sleep(0.5)


async def one_request(http: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int, tokenizer) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    gaps, first, last, usage, text = [], None, None, None, []
    async with http.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                delta = choice.get("text") or ""
                if not delta:
                    continue
                now = time.perf_counter()
                text.append(delta)
                if first is None:
                    first = now
                else:
                    tokens = max(1, len(tokenizer.encode(delta, add_special_tokens=False)))
                    gaps.extend([(now - last) / tokens] * tokens)
                last = now
    completion = "".join(text)
    tokens = usage["completion_tokens"] if usage else len(tokenizer.encode(completion, add_special_tokens=False))
    prompt_tokens = usage["prompt_tokens"] if usage else 0
    return {"ttft": (first or time.perf_counter()) - started, "gaps": gaps, "tokens": tokens, "text": completion,
            "prompt_tokens": prompt_tokens}


async def run_level(url: str, model: str, prompts: list[str], clients: int, per_client: int, max_tokens: int,
                    tokenizer) -> dict:
    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=clients + 4)) as http:
        async def client(index: int) -> list[dict]:
            results = []
            for j in range(per_client):
                prompt = prompts[(index * per_client + j) % len(prompts)]
                results.append(await one_request(http, url, model, prompt, max_tokens, tokenizer))
            return results

        started = time.perf_counter()
        outcomes = await asyncio.gather(*(client(i) for i in range(clients)))
        wall = time.perf_counter() - started
    results = [r for per in outcomes for r in per]
    gaps = sorted(g for r in results for g in r["gaps"])
    total = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "tokens": total, "wall_s": wall, "tok_s": total / wall,
            "prompt_tokens": sum(r["prompt_tokens"] for r in results),
            "itl_p50_ms": 1000 * gaps[len(gaps) // 2] if gaps else float("nan"),
            "itl_p99_ms": 1000 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else float("nan"),
            "ttft_mean_s": statistics.mean(r["ttft"] for r in results)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of: " + ", ".join(CONFIGS))
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    parser.add_argument("--draftwise-flags", default="",
                        help='more `draftwise serve` flags for every draftwise server, e.g. "--activations int8"')
    args = parser.parse_args()

    import draftwise
    from draftwise.bench.suite import default_prompt_dir, load_suite

    engine = draftwise.load(args.model, drafter="none", progress=False)
    tokenizer = engine.tokenizer
    suite = load_suite(default_prompt_dir())
    prompts = [tokenizer.apply_chat_template(list(p.messages), add_generation_prompt=True, tokenize=False) for p in suite]
    del engine
    levels = [int(c) for c in args.clients.split(",")]
    rows = []
    for name in args.configs.split(","):
        # llama.cpp's server keeps the last prompt's keys and values and reuses any common prefix,
        # so a prompt it saw before (the warm-up's, an earlier level's) would skip its prefill:
        # it gets a fresh server per level, warmed up on a prompt no level sends. draftwise has
        # no prompt cache; one server serves all its levels (its controller keeps what it learnt).
        fresh_per_level = CONFIGS[name] is None
        process = None
        try:
            for level, clients in enumerate(levels):
                if process is None or fresh_per_level:
                    if process is not None:
                        stop_server(process)
                    flags = None if CONFIGS[name] is None else CONFIGS[name] + args.draftwise_flags.split()
                    process, url = start_server(name, flags, args.model, args.max_batch, args.threads)
                    asyncio.run(run_level(url, args.model, prompts[-1:], 1, 1, 8, tokenizer))  # warm-up
                row = {"config": name, **asyncio.run(run_level(url, args.model, prompts, clients, args.requests_per_client,
                                                               args.max_tokens, tokenizer))}
                rows.append(row)
                print(f"{name:<22} {clients:>3} clients: {row['tok_s']:7.1f} tok/s  ITL p50 {row['itl_p50_ms']:6.1f} ms "
                      f"p99 {row['itl_p99_ms']:7.1f} ms  TTFT {row['ttft_mean_s']:6.2f} s  "
                      f"({row['tokens']} tokens, {row['prompt_tokens']} prompt tokens, {row['requests']} requests, "
                      f"{row['wall_s']:.1f} s)", flush=True)
        finally:
            if process is not None:
                stop_server(process)
    print("\n| server | clients | tok/s | vs 1 client | ITL p50 (ms) | ITL p99 (ms) | mean TTFT (s) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        single = next(r["tok_s"] for r in rows if r["config"] == row["config"] and r["clients"] == levels[0])
        print(f"| {row['config']} | {row['clients']} | {row['tok_s']:.1f} | {row['tok_s'] / single:.2f}x | "
              f"{row['itl_p50_ms']:.1f} | {row['itl_p99_ms']:.1f} | {row['ttft_mean_s']:.2f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
