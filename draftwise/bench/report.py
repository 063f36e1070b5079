"""Benchmark rows -> per-category summary, JSON, a markdown table and PNG plots."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from draftwise.models.kernels import describe_machine

# Speed-ups are reported against each of these that ran.
BASELINES = ("draftwise plain", "transformers plain", "transformers prompt lookup", "transformers universal assisted",
             "llama.cpp plain")


def speedup_key(baseline: str) -> str:
    return f"speedup_vs_{baseline.replace(' ', '_')}"


def summarize(rows: list[dict]) -> list[dict]:
    """Aggregate per (category, method) and over all prompts ("all"): throughput is total tokens
    over total seconds; speed-ups are ratios against each baseline measured in the same run."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["category"], row["method"])].append(row)
        groups[("all", row["method"])].append(row)
    summary = []
    for (category, method), members in groups.items():
        tokens = sum(r["num_tokens"] for r in members)
        seconds = sum(r["seconds"] for r in members)
        entry = {"category": category, "method": method, "num_prompts": len(members), "num_tokens": tokens,
                 "tokens_per_second": tokens / seconds if seconds else 0.0,
                 "num_mismatches": sum(1 for r in members if r["same_as_reference"] is False),
                 "reference": members[0]["reference"]}
        stats = [r["metrics"] for r in members if r["metrics"]]
        if stats:
            forwards = sum(m["num_target_forwards"] for m in stats)
            drafted = sum(m["num_draft_tokens"] for m in stats)
            total = sum(m["total_s"] for m in stats)
            entry.update({
                "mean_accepted_length": sum(m["num_committed_tokens"] for m in stats) / forwards,
                "acceptance_rate": sum(m["num_accepted_tokens"] for m in stats) / drafted if drafted else 0.0,
                "per_position_acceptance": _per_position(stats),
                "draft_share": sum(m["draft_s"] for m in stats) / total,
                "target_share": sum(m["verify_s"] + m["prefill_s"] for m in stats) / total,  # target forwards
                "overhead_share": sum(m["overhead_s"] for m in stats) / total,
                # everything outside model forwards and drafting, per step, over one target forward
                "overhead_vs_forward": sum(m["overhead_s"] + m["verify_s"] - m["target_forward_s"] for m in stats)
                / max(1e-12, sum(m["target_forward_s"] for m in stats)),
            })
        summary.append(entry)
    rates = {(e["category"], e["method"]): e["tokens_per_second"] for e in summary}
    for entry in summary:
        for baseline in BASELINES:
            base = rates.get((entry["category"], baseline))
            entry[speedup_key(baseline)] = entry["tokens_per_second"] / base if base else None
    return summary


def _per_position(stats: list[dict]) -> list[float]:
    proposed: list[int] = []
    accepted: list[int] = []
    for m in stats:
        for index, (p, a) in enumerate(zip(m["proposed_per_position"], m["accepted_per_position"])):
            if index == len(proposed):
                proposed.append(0)
                accepted.append(0)
            proposed[index] += p
            accepted[index] += a
    return [a / p if p else 0.0 for a, p in zip(accepted, proposed)]


def markdown_table(summary: list[dict], title: str) -> str:
    present = {e["method"] for e in summary}
    baselines = [b for b in BASELINES if b in present]
    lines = [f"### {title}", "",
             "| category | method | tok/s | " + " | ".join(f"vs {b}" for b in baselines)
             + " | tokens/forward | acceptance | time: draft / target / overhead | overhead per step vs forward "
             "| mismatches (vs reference) |",
             "|---|---|---|" + "---|" * len(baselines) + "---|---|---|---|---|"]
    for e in sorted(summary, key=lambda e: (e["category"] == "all", e["category"])):
        cells = [e["category"], e["method"], f"{e['tokens_per_second']:.2f}"]
        for baseline in baselines:
            ratio = e.get(speedup_key(baseline))
            cells.append("" if ratio is None else f"{ratio:.2f}x")
        if "mean_accepted_length" in e:
            cells += [f"{e['mean_accepted_length']:.2f}", f"{100 * e['acceptance_rate']:.0f}%",
                      f"{100 * e['draft_share']:.0f}% / {100 * e['target_share']:.0f}% / {100 * e['overhead_share']:.1f}%",
                      f"{100 * e['overhead_vs_forward']:.1f}%"]
        else:  # peers report no speculation statistics
            cells += ["", "", "", ""]
        cells.append("" if e["reference"] is None else f"{e['num_mismatches']} (vs {e['reference']})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(out_dir: Path, config: dict, rows: list[dict], skipped: list[str]) -> list[Path]:
    """Write bench.json, bench.md and the plots; return the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(rows)
    transformers_dtype = config.get("transformers_dtype")
    title = (f"{config['model']} (draft {config['draft_model'] or '-'}), {config['dtype']}"
             f"{f' with {activations} activations' if (activations := config.get('activations')) else ''}"
             f"{f', {kv_cache} KV cache' if (kv_cache := config.get('kv_cache')) and kv_cache != 'auto' else ''}"
             f"{f' (transformers {transformers_dtype})' if transformers_dtype else ''}, "
             f"max_new_tokens {config['max_new_tokens']}, median of {config['repeats']}, "
             f"{config['threads']} threads"
             f"{', prompts as plain text (no chat template)' if config.get('prompts_as') == 'plain text' else ''}")
    machine = f" on {describe_machine(config['machine'])}" if config.get("machine") else ""
    table = markdown_table(summary, title + machine)  # every number beside the CPU and kernels it ran on
    if skipped:
        table += "\nSkipped:\n" + "".join(f"- {note}\n" for note in skipped)
    paths = [out_dir / "bench.json", out_dir / "bench.md"]
    paths[0].write_text(json.dumps({"config": config, "skipped": skipped, "summary": summary, "rows": rows}, indent=2))
    paths[1].write_text(table)
    return paths + _plots(out_dir, summary, title)


def _plots(out_dir: Path, summary: list[dict], title: str) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []  # the CLI says how to get plots (pip install matplotlib)
    categories = sorted({e["category"] for e in summary if e["category"] != "all"}) + ["all"]
    methods = [m for m in dict.fromkeys(e["method"] for e in summary) if m != "draftwise plain"]
    lookup = {(e["category"], e["method"]): e for e in summary}
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(categories)), 4.5))
    width = 0.8 / max(1, len(methods))
    for index, method in enumerate(methods):
        values = [(lookup.get((c, method)) or {}).get(speedup_key("draftwise plain")) or 0 for c in categories]
        ax.bar([i + index * width for i in range(len(categories))], values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(categories))], categories)
    ax.set_ylabel("speed-up over draftwise plain")
    ax.set_title(title, fontsize=9)
    speedup = _save(fig, ax, out_dir / "speedup.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in methods:
        curve = (lookup.get(("all", method)) or {}).get("per_position_acceptance")
        if curve:
            ax.plot(range(1, len(curve) + 1), curve, marker="o", label=method)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (of drafts reaching the position)")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    acceptance = _save(fig, ax, out_dir / "acceptance.png")
    return [speedup, acceptance]


def _save(fig, ax, path: Path) -> Path:
    import matplotlib.pyplot as plt

    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
