"""Forward cost per weight format: ms for one forward of 1 / 2 / 4 / 9 / 16 tokens after a
300-token prefill (the minimum over rounds), the prefill rate of a long prompt (in the forwards
the engine runs it in: 512 tokens at a time on AMX tiles, else whole), and peak RSS.

    python benchmarks/forward_cost.py --model qwen2.5-coder-1.5b --dtype auto float32 --threads 2

Run each format in its own process (--dtype takes one value per run, so peak RSS is that
format's alone) or several in one (their memory adds up). --activations int8 times the int8-
activation kernel; --llama-cpp times llama.cpp (llama-cpp-python) on the model's GGUF file the
same way instead: the same cache length, token counts and prefill. --activations defaults to
the library's own default (auto: bf16 on a GGUF model's blocks where the CPU has AVX-512 BF16);
--activations float32 times the exact float32 arithmetic."""

from __future__ import annotations

import argparse
import resource
import time

import torch

from draftwise.engine import Engine
from draftwise.models import loading
from draftwise.models.linear import ACTIVATIONS


def forward_ms(model, num_tokens: int, rounds: int = 4, context: int = 300) -> float:
    cache = model.new_cache(context + 64)
    tokens = torch.randint(1000, (context,))
    model.forward(tokens, torch.arange(context), cache, num_logits=1)
    best = float("inf")
    for _ in range(rounds):
        for _ in range(3):
            draft = torch.randint(1000, (num_tokens,))
            tic = time.perf_counter()
            model.forward(draft, torch.arange(context, context + num_tokens), cache)
            best = min(best, time.perf_counter() - tic)
            cache.truncate(context)
    return best * 1000


def prefill_rate(model, num_tokens: int, chunk: int | None = None) -> float:
    """Tokens/s of a num_tokens prompt's prefill, in forwards of `chunk` tokens as the engine
    runs them (None: one forward)."""
    cache = model.new_cache(num_tokens)
    tokens = torch.randint(1000, (num_tokens,))
    chunk = chunk or num_tokens
    tic = time.perf_counter()
    for start in range(0, num_tokens, chunk):
        end = min(num_tokens, start + chunk)
        model.forward(tokens[start:end], torch.arange(start, end), cache, num_logits=1)
    return num_tokens / (time.perf_counter() - tic)


def llama_cpp_costs(model: str, threads: int, prefill: int, rounds: int = 4, context: int = 300) -> None:
    from llama_cpp import Llama

    from draftwise.models import registry

    llm = Llama(model_path=str(registry.gguf_path(model)), n_threads=threads, n_threads_batch=threads,
                n_ctx=max(prefill, context + 64), verbose=False)
    llm.eval(list(range(1000, 1000 + context)))
    costs = {}
    for num_tokens in (1, 2, 4, 9, 16):
        best = float("inf")
        for _ in range(rounds * 3):
            llm.n_tokens = context  # drop what the last forward added, as cache.truncate does
            tic = time.perf_counter()
            llm.eval(list(range(2000, 2000 + num_tokens)))
            best = min(best, time.perf_counter() - tic)
        costs[num_tokens] = best * 1000
    llm.reset()
    tic = time.perf_counter()
    llm.eval([1000 + (7 * i) % 5000 for i in range(prefill)])
    rate = prefill / (time.perf_counter() - tic)
    row = " / ".join(f"{costs[n]:.1f}" for n in costs)
    ratios = " / ".join(f"{costs[n] / costs[1]:.2f}x" for n in costs)
    print(f"{model} llama.cpp (its GGUF file): forward ms for 1/2/4/9/16 tokens: {row} ({ratios}) | "
          f"prefill {prefill} tokens: {rate:.0f} tok/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", nargs="+", default=["auto"])
    parser.add_argument("--quantize", default=None)
    parser.add_argument("--activations", default="auto", choices=list(ACTIVATIONS),
                        help="as draftwise generate's (default auto: the library's default; the output says which ran)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--llama-cpp", action="store_true", help="time llama.cpp on the GGUF file instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.llama_cpp:
        return llama_cpp_costs(args.model, args.threads, args.prefill)
    for dtype in args.dtype:
        tic = time.perf_counter()
        loaded = loading.load(args.model, dtype=dtype, quantize=args.quantize, progress=False,
                              activations=args.activations)
        model = loaded.model
        load_s = time.perf_counter() - tic
        costs = {n: forward_ms(model, n) for n in (1, 2, 4, 9, 16)}
        one = costs[1]
        row = " / ".join(f"{costs[n]:.1f}" for n in costs)
        ratios = " / ".join(f"{costs[n] / one:.2f}x" for n in costs)
        chunk = Engine(loaded).prefill_chunk  # the engine's: 512-token forwards on AMX tiles, else whole
        rate = prefill_rate(model, args.prefill, chunk) if args.prefill else float("nan")
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"{args.model} dtype={dtype} quantize={args.quantize} activations={loaded.activations}: load {load_s:.1f} s | forward ms for "
              f"1/2/4/9/16 tokens: {row} ({ratios}) | prefill {args.prefill} tokens"
              f"{f' in {chunk}-token forwards' if chunk else ''}: {rate:.0f} tok/s | "
              f"peak RSS {rss_mb:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
