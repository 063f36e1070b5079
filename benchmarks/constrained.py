"""Constrained generation (tool calls, JSON schemas) with and without speculation, side by side
in ONE process (a shared VM's drift then moves every column alike).

    python benchmarks/constrained.py --model qwen2.5-coder-1.5b --drafters ngram,eagle
    python benchmarks/constrained.py --model smollm2-135m --workload json --drafters ngram,eagle

`--workload tools`: four questions a weather tool and a time tool answer, each asked with
tool_choice "auto" (nothing constrains the reply) and "required" (a grammar: the reply is calls
of the tools, draftwise.tools). `--workload json`: three extraction tasks (a person, a review, an
order), each answered as JSON its schema allows (draftwise.structured). Per task, plain decoding
and every drafter run in alternating order per round (best round kept), each drafter also with
the grammar's forced tokens NOT drafted (`name-unforced`: draftwise.step._forced_tokens switched
off), so what forced drafts add is measured in the same run. Every output must equal plain
decoding's (the script stops if not). Prints per task the tokens, each configuration's tokens
per forward and speed-up, then the speed-up over all tasks.
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

import draftwise
from draftwise import step, structured
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
EXTRACTIONS = {
    "person": ("Extract the person's details as JSON.\n\nMaria Gonzalez, 34, is a nurse who lives in Valencia, "
               "Spain. Reach her at maria.gonzalez@example.com.",
               {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                 "occupation": {"type": "string"}, "city": {"type": "string"},
                                                 "country": {"type": "string"}, "email": {"type": "string"}},
                "required": ["name", "age", "occupation", "city", "country", "email"], "additionalProperties": False}),
    "review": ("Classify this review as JSON.\n\nThe battery lasts two days and the screen is gorgeous, but the "
               "speakers crackle at high volume. Still, for the price I'd buy it again.",
               {"type": "object", "properties": {"sentiment": {"type": "string", "enum": ["positive", "negative", "mixed"]},
                                                 "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                                                 "pros": {"type": "array", "items": {"type": "string"}},
                                                 "cons": {"type": "array", "items": {"type": "string"}}},
                "required": ["sentiment", "rating", "pros", "cons"], "additionalProperties": False}),
    "order": ("Turn this order into JSON.\n\n2 large pepperoni pizzas at $14.50 each, 1 garlic bread at $4.25, 3 cans "
              "of cola at $1.75 each. Deliver to 12 Elm Street.",
              {"type": "object", "properties": {
                  "items": {"type": "array", "items": {"type": "object", "properties": {
                      "name": {"type": "string"}, "quantity": {"type": "integer"}, "unit_price": {"type": "number"}},
                      "required": ["name", "quantity", "unit_price"], "additionalProperties": False}},
                  "address": {"type": "string"}}, "required": ["items", "address"], "additionalProperties": False}),
}


def tasks(workload: str, tokenizer) -> list[tuple[str, list, str | None, ToolUse | None]]:
    """(label, messages, grammar, tools) per task: the tool questions twice, or the extractions."""
    if workload == "json":
        return [(name, [{"role": "user", "content": text}], structured.json_schema(schema), None)
                for name, (text, schema) in EXTRACTIONS.items()]
    out = []
    for choice in ("auto", "required"):
        tools = ToolUse(tokenizer, TOOLS, choice)
        out += [(choice, [{"role": "user", "content": question}], tools.grammar, tools) for question in QUESTIONS]
    return out


@contextmanager
def forced_drafts(enabled: bool):
    original = step._forced_tokens
    if not enabled:
        step._forced_tokens = lambda seq: None
    try:
        yield
    finally:
        step._forced_tokens = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--workload", default="tools", choices=["tools", "json"])
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
    for label, messages, grammar, tools in tasks(args.workload, engines["plain"].tokenizer):
        prompt = engines["plain"].encode(messages, tools.tools if tools is not None else None)
        best, results = {name: float("inf") for name in configs}, {}
        for round_ in range(args.rounds):
            for name in (configs if round_ % 2 == 0 else configs[::-1]):
                with forced_drafts(not name.endswith("-unforced")):
                    tic = time.perf_counter()
                    results[name] = engines[name].generate(prompt, max_new_tokens=args.max_new_tokens, grammar=grammar)
                    best[name] = min(best[name], time.perf_counter() - tic)
        plain = results["plain"]
        for name in configs:
            if results[name].token_ids != plain.token_ids:
                raise SystemExit(f"{label} {messages[-1]['content'][:40]!r}: {name}'s output differs from plain decoding's")
            totals[name] += best[name]
        columns = "  ".join(f"{name} {results[name].metrics.mean_accepted_length:.2f}/fwd "
                            f"{best['plain'] / best[name]:.2f}x" for name in configs[1:])
        shown = ""
        if tools is not None:
            shown = "  calls: " + (", ".join(f"{c.name}{c.arguments}" for c in tools.parse(plain.text)[1]) or "none")
        print(f"{label:8} {len(plain.token_ids):3} tokens  {columns}{shown}")
    print("all tasks: " + ", ".join(f"{name} {totals['plain'] / totals[name]:.2f}x plain" for name in configs[1:])
          + f" ({describe_machine(machine())})")


if __name__ == "__main__":
    main()
