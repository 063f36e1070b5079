"""The server's continuous batching without HTTP: plain batched decoding against `ngram` with the
draft-length controller, alternated round by round in ONE process (a shared VM's drift then moves
both alike, where benchmarks/serve_load.py runs one server after another).

    python benchmarks/batch_replay.py --model smollm2-135m --clients 4 --requests-per-client 2
    python benchmarks/batch_replay.py --model smollm2-135m --clients 16 --requests-per-client 1
    python benchmarks/batch_replay.py --model smollm2-135m --clients 16 --requests-per-client 1 --prefix-cache-mb 512

Client c sends the bench suite's prompts c*R .. c*R+R-1 (rendered by the chat template) one after
another into draftwise.scheduler.Scheduler, greedy, --max-tokens each; a round's rate is its
generated tokens over its wall time. Per configuration and round it prints tokens/s and where the
forwards went: decoding-only steps (rows per step, draft tokens the controller kept), steps that
mix a prefill chunk with decoding rows, and prefill-only steps. --prefix-cache-mb adds the
controller with `draftwise serve`'s prefix cache as a third configuration, emptied at each round
(the suite's prompts share only the chat template's opening, so this measures what keeping
finished requests costs against what that opening saves).
"""

from __future__ import annotations

import argparse
import time

import draftwise
from draftwise.bench.suite import default_prompt_dir, load_suite
from draftwise.config import SamplingParams
from draftwise.scheduler import Request, Scheduler

CONFIGS = {"plain batched": {"drafter": "none"},
           "batched + controller": {"drafter": "ngram", "draft_length": "adaptive"}}


def replay(engine, prompts: list[list[int]], clients: int, per_client: int, max_tokens: int, max_batch: int) -> str:
    stats = {"decode": [0, 0.0, 0, 0], "mixed": [0, 0.0, 0, 0], "prefill": [0, 0.0, 0, 0]}  # steps, s, rows, drafted

    def on_step(report, running) -> None:
        kind = ("mixed" if report.num_rows > report.num_prefill_rows else "prefill") if report.num_prefill_rows \
            else "decode"
        row = stats[kind]
        row[0] += 1
        row[1] += report.forward_s
        row[2] += report.num_rows
        row[3] += sum(report.draft_tokens_chosen)

    scheduler = Scheduler(engine, max_batch, on_step=on_step)
    queues = [[prompts[c * per_client + r] for r in range(per_client)] for c in range(clients)]
    current: list[Request | None] = [None] * clients
    requests = []
    started = time.perf_counter()
    scheduler.start()
    try:
        while True:
            active = False
            for c in range(clients):
                request = current[c]
                if request is not None and not (request.sequence is not None and request.sequence.finished):
                    active = True
                elif queues[c]:
                    current[c] = scheduler.submit(Request(queues[c].pop(0), SamplingParams(max_new_tokens=max_tokens),
                                                          lambda event: None))
                    requests.append(current[c])
                    active = True
            if not active:
                break
            time.sleep(0.002)
    finally:
        scheduler.stop()
    wall = time.perf_counter() - started
    tokens = sum(request.sequence.metrics.num_generated_tokens for request in requests)
    decode, mixed, prefill = stats["decode"], stats["mixed"], stats["prefill"]
    return (f"{tokens / wall:6.1f} tok/s ({tokens} tokens, {wall:.1f} s) | decoding steps {decode[0]}: {decode[1]:.1f} s, "
            f"{decode[2] / max(1, decode[0]):.1f} rows a step, {decode[3]} draft tokens | mixed steps {mixed[0]}: "
            f"{mixed[1]:.1f} s, {mixed[3]} draft tokens | prefill-only steps {prefill[0]}: {prefill[1]:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prefix-cache-mb", type=int, default=0,
                        help="also run the controller with a prefix cache of this size (draftwise serve's default: 512)")
    args = parser.parse_args()
    engines = {name: draftwise.load(args.model, progress=False, **flags) for name, flags in CONFIGS.items()}
    if args.prefix_cache_mb:
        engines["controller + prefix cache"] = draftwise.load(args.model, progress=False, **CONFIGS["batched + controller"])
        engines["controller + prefix cache"].prefix_cache = draftwise.PrefixCache(args.prefix_cache_mb << 20)
    tokenizer = engines["plain batched"].tokenizer
    texts = [tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=False)
             for prompt in load_suite(default_prompt_dir())]
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    if args.clients * args.requests_per_client > len(prompts):
        parser.error(f"{args.clients} clients x {args.requests_per_client} requests need more than the suite's "
                     f"{len(prompts)} prompts: ask for fewer")
    for round_ in range(1, args.rounds + 1):
        for name, engine in engines.items():
            if engine.prefix_cache is not None:  # empty each round: the rounds replay the same prompts
                engine.prefix_cache = draftwise.PrefixCache(args.prefix_cache_mb << 20)
            result = replay(engine, prompts, args.clients, args.requests_per_client, args.max_tokens, args.max_batch)
            print(f"round {round_} | {name:25s} | {args.clients} clients | {result}", flush=True)


if __name__ == "__main__":
    main()
