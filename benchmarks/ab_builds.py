"""Two checkouts of draftwise (or one and llama.cpp) timed side by side: each side is a
long-lived process, and the two take turns, one waiting on a pipe while the other times, so both
see the same minutes of a noisy shared machine. Prints the best and the median of each job over
the rounds, and their ratio.

    git worktree add /tmp/before HEAD~1
    python benchmarks/ab_builds.py /tmp/before . --model qwen2.5-coder-1.5b --forward 1 2 --rounds 12
    python benchmarks/ab_builds.py /tmp/before . --matrix layers.0.mlp.gate_proj --rows 1 --threads 1
    python benchmarks/ab_builds.py llama.cpp . --activations int8 --forward 1 --prefill 2048 --rounds 2
    python benchmarks/ab_builds.py /tmp/before . --activations int8 --attention 2048@0 1@2047 --calls 3
    python benchmarks/ab_builds.py . . --activations bf16 int16 --forward 1 9 --prefill 512 --rounds 4

A side is a checkout's folder (its draftwise is imported through PYTHONPATH, and builds its own
kernels on first use) or `llama.cpp` (llama-cpp-python on the model's GGUF file: forwards and
prefill only). `--activations A B` gives the two sides different settings (one checkout against
itself: two activation settings side by side). Two builds of the kernels cannot be compared inside one process: glibc's dlopen
hands back the first draftwise_kernels.so for the second (the same SONAME), so both would be one.
Forwards follow a 64-token prompt and are rolled back after each; --matrix times one product of
the first layer's (or the LM head's) weight, as benchmarks/kernel_cost.py names them; --attention
T@START times one layer's attention kernel in the model's shape and KV-cache dtype: T new queries
over START cached slots (causal), random values."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

CONTEXT = 64  # prompt tokens before each timed forward


# A job: the call timed, then what puts the model back for the next call (untimed).
Job = tuple[Callable[[], None], Callable[[], None]]


def _draftwise_worker(model_name: str, activations: str) -> Callable[[str, str], Job]:
    """Job maker on draftwise: (kind, size) -> Job."""
    import torch

    import draftwise
    from kernel_cost import matrices  # benchmarks/kernel_cost.py: this script's folder comes first on sys.path

    model = draftwise.load(model_name, progress=False, activations=activations).target.model
    cache = model.new_cache(CONTEXT + 64)
    model.forward(torch.randint(1000, (CONTEXT,)), torch.arange(CONTEXT), cache, num_logits=1)
    weights = matrices(model)

    def run(kind: str, size: str) -> Job:
        if kind == "forward":
            tokens, positions = torch.randint(1000, (int(size),)), torch.arange(CONTEXT, CONTEXT + int(size))
            return (lambda: model.forward(tokens, positions, cache)), (lambda: cache.truncate(CONTEXT))
        if kind == "prefill":
            prompt_cache, tokens = model.new_cache(int(size)), torch.randint(1000, (int(size),))
            return (lambda: model.forward(tokens, torch.arange(int(size)), prompt_cache, num_logits=1),
                    lambda: prompt_cache.truncate(0))
        if kind == "attention":
            return _attention_job(model, *(int(n) for n in size.split("@")))
        name, rows = size.rsplit("@", 1)
        linear, x = weights[name], torch.randn(int(rows), weights[name].weight.num_columns)
        return (lambda: linear(x)), (lambda: None)

    return run


def _attention_job(model, new: int, start: int) -> Job:
    """One layer's attention kernel: `new` queries after `start` cached slots, the model's heads,
    head size and cache dtype."""
    import torch

    from draftwise.models.kernels import native_kernels

    kernels, shape = native_kernels(progress=False), model.shape
    dtype = model.new_cache(1).keys.dtype
    queries = torch.randn(new, shape.num_heads, shape.head_dim)
    keys, values = (torch.randn(shape.num_kv_heads, start + new, shape.head_dim).to(dtype) for _ in range(2))
    causal = torch.empty(0, dtype=torch.bool)
    return (lambda: kernels.attention(queries, keys, values, start, causal, shape.head_dim ** -0.5, False)), \
        (lambda: None)


def _llama_cpp_worker(model_name: str, threads: int) -> Callable[[str, str], Job]:
    from llama_cpp import Llama

    from draftwise.models import registry

    llm = Llama(model_path=str(registry.gguf_path(model_name)), n_threads=threads, n_threads_batch=threads,
                n_ctx=4096, verbose=False)
    prompt = list(range(1000, 1000 + CONTEXT))
    llm.eval(prompt)

    def restore_prompt() -> None:
        llm.reset()
        llm.eval(prompt)

    def run(kind: str, size: str) -> Job:
        if kind == "forward":
            tokens = list(range(2000, 2000 + int(size)))

            def drop_forward() -> None:
                llm.n_tokens = CONTEXT  # as cache.truncate: the next forward writes over what this one added

            return (lambda: llm.eval(tokens)), drop_forward
        tokens = [1000 + (7 * i) % 5000 for i in range(int(size))]

        def prefill() -> None:
            llm.reset()
            llm.eval(tokens)

        return prefill, restore_prompt

    return run


def worker(side: str, model_name: str, activations: str, threads: int) -> None:
    """Reads 'kind size calls' lines on stdin and answers each with the best seconds of its calls."""
    import torch

    torch.set_num_threads(threads)
    run = _llama_cpp_worker(model_name, threads) if side == "llama.cpp" else _draftwise_worker(model_name, activations)
    print("ready", flush=True)
    for line in sys.stdin:
        kind, size, calls = line.split()
        job, restore = run(kind, size)
        job()  # warm: first-call allocations, caches
        restore()
        best = float("inf")
        for _ in range(int(calls)):
            tic = time.perf_counter()
            job()
            best = min(best, time.perf_counter() - tic)
            restore()
        print(best, flush=True)


def start(side: str, activations: str, args: argparse.Namespace) -> subprocess.Popen:
    env = dict(os.environ)
    if side == "llama.cpp" and importlib.util.find_spec("llama_cpp") is None:
        raise SystemExit("ab_builds: llama-cpp-python is not installed: pip install 'draftwise[llamacpp]' "
                         "(it builds llama.cpp from source for this CPU, a few minutes)")
    if side != "llama.cpp":
        folder = Path(side).resolve()
        if not (folder / "draftwise" / "__init__.py").is_file():
            raise SystemExit(f"ab_builds: {side} is not a draftwise checkout (no draftwise/__init__.py there) "
                             "nor `llama.cpp`; give a folder such as a `git worktree add` of the commit to compare")
        env["PYTHONPATH"] = str(folder)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--model", args.model,
               "--activations", activations, "--threads", str(args.threads)]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    if process.stdout.readline().strip() != "ready":
        raise SystemExit(f"ab_builds: the {side} side did not start (its error is above)")
    return process


def ask(process: subprocess.Popen, job: str) -> float:
    process.stdin.write(job + "\n")
    process.stdin.flush()
    answer = process.stdout.readline()
    if not answer:
        raise SystemExit(f"ab_builds: a side stopped during '{job}' (its error is above)")
    return float(answer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", nargs="?", help="a draftwise checkout's folder, or llama.cpp")
    parser.add_argument("after", nargs="?", help="a draftwise checkout's folder, or llama.cpp")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--activations", nargs="+", default=["float32"],
                        help="the draftwise sides' (default float32); two values: the before side's, then the after side's")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--forward", nargs="*", type=int, default=[], help="tokens a forward, after a 64-token prompt")
    parser.add_argument("--prefill", nargs="*", type=int, default=[], help="prompt lengths, one forward each")
    parser.add_argument("--matrix", nargs="*", default=[], help="weights by kernel_cost.py's names, e.g. lm_head")
    parser.add_argument("--rows", type=int, default=1, help="rows of x for --matrix")
    parser.add_argument("--attention", nargs="*", default=[],
                        help="one layer's attention kernel, NEW@CACHED: e.g. 2048@0 (a prefill), 1@2047 (a decode step)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=5, help="calls a job a round (its best is the round's)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.model, args.activations[0], args.threads)
    jobs = ([f"forward {n}" for n in args.forward] + [f"prefill {n}" for n in args.prefill]
            + [f"matrix {name}@{args.rows}" for name in args.matrix]
            + [f"attention {size}" for size in args.attention])
    if not (args.before and args.after):
        parser.error("give the two sides to compare: two checkouts' folders, or one and llama.cpp")
    if not jobs:
        parser.error("nothing to time: give --forward, --prefill, --matrix or --attention")
    if (args.matrix or args.attention) and "llama.cpp" in (args.before, args.after):
        parser.error("llama.cpp times forwards and prefill only: drop --matrix and --attention, or compare two checkouts")
    for size in args.attention:
        if not re.fullmatch(r"[1-9][0-9]*@[0-9]+", size):
            parser.error(f"--attention {size}: give NEW@CACHED, e.g. 2048@0 or 1@2047")
    if len(args.activations) > 2:
        parser.error("--activations takes one setting (both sides) or two (the before side's, then the after side's)")
    settings = {"before": args.activations[0], "after": args.activations[-1]}
    sides = {side: start(getattr(args, side), settings[side], args) for side in settings}
    times = {(side, job): [] for side in sides for job in jobs}
    for round_ in range(args.rounds):
        for job in jobs:
            order = ("before", "after") if round_ % 2 == 0 else ("after", "before")
            for side in order:
                times[(side, job)].append(ask(sides[side], f"{job} {args.calls}"))
        print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)
    for process in sides.values():
        process.stdin.close()
        process.wait()
    activations = settings["before"] if settings["before"] == settings["after"] else " / ".join(settings.values())
    print(f"{args.model}, {activations} activations, {args.threads} threads, {args.rounds} rounds taking turns; "
          f"before = {args.before}, after = {args.after}")
    print("| job | before best / median, ms | after best / median, ms | before / after (best, median) |")
    print("|---|---|---|---|")
    for job in jobs:
        before, after = times[("before", job)], times[("after", job)]
        b, a = min(before) * 1e3, min(after) * 1e3
        bm, am = statistics.median(before) * 1e3, statistics.median(after) * 1e3
        label = job.replace("@", " new over ") + " cached" if job.startswith("attention") else job.replace("@", ", rows ")
        print(f"| {label} | {b:.2f} / {bm:.2f} | {a:.2f} / {am:.2f} | {b / a:.3f}x, {bm / am:.3f}x |")


if __name__ == "__main__":
    main()
