"""The benchmark task suite: JSON Lines files of chat prompts, one file per category."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from draftwise.errors import ConfigError


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    id: str
    category: str
    messages: tuple[dict, ...]  # chat messages, rendered with the model's chat template

    def as_text(self) -> str:
        """The messages as one plain-text prompt (messages_text), for a base model without a chat template."""
        return messages_text(self.messages)

    def input(self, chat: bool) -> list[dict] | str:
        """What a method is given: the messages (chat: the model has a chat template), else as_text()."""
        return list(self.messages) if chat else self.as_text()


def messages_text(messages) -> str:
    """Chat messages' contents as one plain-text prompt, blank lines between them: what a base
    model without a chat template is given in their place."""
    return "\n\n".join(m["content"] for m in messages if isinstance(m.get("content"), str))


def default_prompt_dir() -> Path:
    """benchmarks/prompts of the source checkout draftwise runs from."""
    return Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"


def load_suite(folder: Path, categories: list[str] | None = None, per_category: int | None = None) -> list[BenchPrompt]:
    """Read every *.jsonl file in folder; keep the given categories and the first per_category of each."""
    if per_category is not None and per_category < 1:
        raise ConfigError(f"per_category={per_category} is invalid: take at least 1 prompt of each category.")
    files = sorted(Path(folder).glob("*.jsonl"))
    if not files:
        raise ConfigError(f"no *.jsonl prompt files in {folder}: pass --prompts DIR (see benchmarks/prompts/README.md).")
    prompts: list[BenchPrompt] = []
    kept: Counter[str] = Counter()
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                prompt = BenchPrompt(record["id"], record["category"], tuple(record["messages"]))
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ConfigError(f"{path}:{number} is not a prompt record ({error}); "
                                  "each line needs id, category and messages.") from None
            if categories and prompt.category not in categories:
                continue
            if per_category is not None and kept[prompt.category] >= per_category:
                continue
            prompts.append(prompt)
            kept[prompt.category] += 1
    if not prompts:
        raise ConfigError(f"no prompt in {folder} matches categories {categories}.")
    return prompts
