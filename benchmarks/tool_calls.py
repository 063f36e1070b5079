"""Tool calls with and without speculation, side by side in ONE process (a shared VM's drift
then moves every column alike).

    python benchmarks/tool_calls.py --model qwen2.5-coder-1.5b --drafters ngram,eagle
    python benchmarks/tool_calls.py --model qwen2.5-coder-0.5b --drafters ngram --rounds 3

Four questions a weather tool and a time tool answer, each asked with tool_choice "auto" (the
model decides; nothing constrains the reply) and "required" (a grammar: the reply is calls of the
tools, draftwise.tools). Per question, plain decoding and every drafter run in alternating order
per round (best round kept), each drafter also with the grammar's forced tokens NOT drafted
(`name-unforced`: draftwise.step._forced_draft switched off), so what forced drafts add is
measured in the same run. Every output must equal plain decoding's (the script stops if not).
Prints per question the tokens, each configuration's tokens per forward and speed-up, then the
speed-up over all questions.
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

import draftwise
from draftwise import step
from draftwise.engine import Engine
from draftwise.models.kernels import describe_machine, machine
from draftwise.tools import ToolUse

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
]
QUESTIONS = ["What's the weather like in Paris right now?", "What time is it in Tokyo, and the weather in Oslo?",
             "I'm flying to Lima tomorrow. Will I need an umbrella there?", "Is it already evening in Sydney?"]


@contextmanager
def forced_drafts(enabled: bool):
    original = step._forced_draft
    if not enabled:
        step._forced_draft = lambda seq: None
    try:
        yield
    finally:
        step._forced_draft = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--drafters", default="ngram,eagle", help="comma-separated drafter names")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    drafters = args.drafters.split(",")
    loaded = {name: draftwise.load(args.model, drafter=name, progress=False) for name in drafters}
    engines = {"plain": Engine(loaded[drafters[0]].target)}
    for name in drafters:
        engines[name] = engines[f"{name}-unforced"] = loaded[name]
    configs = list(engines)
    totals = {name: 0.0 for name in configs}
    for choice in ("auto", "required"):
        tools = ToolUse(engines["plain"].tokenizer, TOOLS, choice)
        for question in QUESTIONS:
            prompt = engines["plain"].encode([{"role": "user", "content": question}], tools.tools)
            best, results = {name: float("inf") for name in configs}, {}
            for round_ in range(args.rounds):
                for name in (configs if round_ % 2 == 0 else configs[::-1]):
                    with forced_drafts(not name.endswith("-unforced")):
                        tic = time.perf_counter()
                        results[name] = engines[name].generate(prompt, max_new_tokens=args.max_new_tokens,
                                                               grammar=tools.grammar)
                        best[name] = min(best[name], time.perf_counter() - tic)
            plain = results["plain"]
            for name in configs:
                if results[name].token_ids != plain.token_ids:
                    raise SystemExit(f"{question!r} ({choice}): {name}'s output differs from plain decoding's")
                totals[name] += best[name]
            calls = [f"{call.name}{call.arguments}" for call in tools.parse(plain.text)[1]]
            columns = "  ".join(f"{name} {results[name].metrics.mean_accepted_length:.2f}/fwd "
                                f"{best['plain'] / best[name]:.2f}x" for name in configs[1:])
            print(f"{choice:8} {len(plain.token_ids):3} tokens  {columns}  calls: {', '.join(calls) or 'none'}")
    print("all questions: " + ", ".join(f"{name} {totals['plain'] / totals[name]:.2f}x plain" for name in configs[1:])
          + f" ({describe_machine(machine())})")


if __name__ == "__main__":
    main()
