"""Fill-in-the-middle with and without speculation, side by side in ONE process (a shared VM's
drift then moves both alike).

    python benchmarks/infill.py --model qwen2.5-coder-1.5b
    python benchmarks/infill.py --model qwen2.5-coder-0.5b --drafter ngram --rounds 3

Three edits an editor's completion asks for, each a middle that echoes its surroundings: a method
mirroring its sibling, the rest of a function whose tests follow, and the remaining keys of a
mapping. Each case runs plain decoding and the drafter, in alternating order per round; their
outputs must be equal (the script stops if not). Prints per case the tokens, the tokens per
forward and both tok/s (best round), and the speed-up over all cases.
"""

from __future__ import annotations

import argparse
import time

import draftwise
from draftwise.infill import infill_prompt

CASES = {
    "sibling method": (
        "class Vector:\n    def __init__(self, x, y, z):\n        self.x, self.y, self.z = x, y, z\n\n"
        "    def __add__(self, other):\n        return Vector(self.x + other.x, self.y + other.y, self.z + other.z)\n\n"
        "    def __sub__(self, other):\n",
        "\n\n    def __repr__(self):\n        return f\"Vector({self.x}, {self.y}, {self.z})\"\n"),
    "function before its tests": (
        "def parse_duration(text: str) -> int:\n    \"\"\"'1h30m' -> 5400 seconds; units h, m, s.\"\"\"\n",
        "\n\ndef test_parse_duration():\n    assert parse_duration('1h30m') == 5400\n    assert parse_duration('45s') == 45\n"
        "    assert parse_duration('2h') == 7200\n    assert parse_duration('10m5s') == 605\n"),
    "rest of a mapping": (
        "HTTP_STATUS = {\n    200: 'OK',\n    201: 'Created',\n    204: 'No Content',\n    301: 'Moved Permanently',\n",
        "\n}\n\n\ndef reason(code: int) -> str:\n    return HTTP_STATUS.get(code, 'Unknown')\n"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    engines = {"plain": draftwise.load(args.model, drafter="none", progress=False),
               args.drafter: draftwise.load(args.model, drafter=args.drafter, progress=False)}
    totals = {name: 0.0 for name in engines}
    for case, (prefix, suffix) in CASES.items():
        ids, stops = infill_prompt(engines["plain"].tokenizer, prefix, suffix)
        best, results = {name: float("inf") for name in engines}, {}
        for round_ in range(args.rounds):
            for name in (list(engines) if round_ % 2 == 0 else list(engines)[::-1]):
                tic = time.perf_counter()
                results[name] = engines[name].generate(ids, max_new_tokens=args.max_new_tokens, stop_token_ids=stops)
                best[name] = min(best[name], time.perf_counter() - tic)
        plain, drafted = results["plain"], results[args.drafter]
        if plain.token_ids != drafted.token_ids:
            raise SystemExit(f"{case}: {args.drafter}'s output differs from plain decoding's")
        tokens = len(plain.token_ids)
        for name in engines:
            totals[name] += best[name]
        print(f"{case}: {tokens} tokens, {drafted.metrics.mean_accepted_length:.2f} a forward; plain "
              f"{tokens / best['plain']:.1f} tok/s, {args.drafter} {tokens / best[args.drafter]:.1f} tok/s "
              f"({best['plain'] / best[args.drafter]:.2f}x)")
    print(f"all cases: {args.drafter} {totals['plain'] / totals[args.drafter]:.2f}x plain ({draftwise.models.kernels.describe_machine(draftwise.models.kernels.machine())})")


if __name__ == "__main__":
    main()
