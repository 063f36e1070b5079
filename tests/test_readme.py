"""The README's Python examples run as they are written: a user copies them first, and an
example that no longer runs (a renamed argument, a moved class) is a bug nobody else reports."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import draftwise
from draftwise.server import ServerThread

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(heading: str) -> list[str]:
    """The ```python blocks between the README heading `heading` and the next heading."""
    blocks, section, block = [], None, None
    for line in README.read_text().splitlines():
        if block is not None:
            if line.startswith("```"):
                blocks.append("\n".join(block)) if section == heading else None
                block = None
            else:
                block.append(line)
        elif line.startswith("```python"):
            block = []
        elif re.match(r"#+ ", line):
            section = line.lstrip("#").strip()
    assert blocks, f"no python block under {heading!r} in the README"
    return blocks


def run(code: str, **names) -> tuple[dict, str]:
    """exec code as a script would run it; its globals and what it printed."""
    namespace = {"__name__": "__readme__", **names}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(README), "exec"), namespace)
    return namespace, printed.getvalue()


def test_the_python_api_example_runs_as_written():
    (code,) = python_blocks("Python")
    namespace, printed = run(code)
    assert isinstance(namespace["engine"], draftwise.Engine)
    assert "tok/s" in printed  # metrics.summary()
    assert namespace["update"].result.text in printed  # the stream's deltas, printed, spell its whole text
    assert 0 < namespace["result"].metrics.num_generated_tokens <= 32  # the settings-by-name call


def test_the_own_drafter_example_runs_as_written():
    (code,) = python_blocks("Your own drafter")
    namespace, _ = run(code, reference_text="def add(a, b):\n    return a + b\n")
    result = namespace["engine"].generate("Write a function that adds two numbers.", max_new_tokens=24)
    assert result.text == namespace["plain"].generate("Write a function that adds two numbers.", max_new_tokens=24).text


def test_the_openai_client_example_runs_against_draftwise_serve():
    (code,) = python_blocks("Serving: `draftwise serve`")
    assert "http://127.0.0.1:8000/v1" in code  # the port the README's `draftwise serve` line listens on
    engine = draftwise.load("smollm2-135m", drafter="ngram", progress=False)
    with ServerThread(engine, max_batch=2) as server:
        namespace, printed = run(code.replace("http://127.0.0.1:8000", server.url))
    content = namespace["reply"].choices[0].message.content
    assert content and content in printed
    assert "mean_accepted_length" in printed  # usage.speculative, then the streamed haiku and its usage
