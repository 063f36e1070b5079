"""The README's Python examples run as they are written: a user copies them first, and an
example that no longer runs (a renamed argument, a moved class) is a bug nobody else reports."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

import draftwise
from draftwise.cli import build_parser
from draftwise.server import ServerThread

README = Path(__file__).resolve().parents[1] / "README.md"
DOCS = sorted((README.parent / "docs").glob("*.md"))  # the README's longer records (docs/heads.md, ...)


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
    second_turn, engine = namespace["answer"].metrics, namespace["engine"]
    # At least the whole first prompt came from the cache (and the answer too, where its text
    # tokenizes back to the same tokens: all but the new turn's ~15 on this project's CPUs).
    first_prompt = len(engine.encode(namespace["chat"][:1]))
    assert first_prompt <= second_turn.num_cached_prompt_tokens < second_turn.num_prompt_tokens


def test_the_logprobs_examples_run_as_written():
    lookup, perplexity = python_blocks("Log-probabilities: `logprobs`")
    namespace, printed = run(lookup)
    assert len(printed.splitlines()) == 4 and "' Paris'" in printed.splitlines()[0]  # SmolLM2's first choice
    namespace, printed = run(perplexity)
    assert printed.startswith("perplexity ") and 1.0 < float(printed.split()[1]) < 1000.0


def test_the_structured_output_example_runs_as_written():
    (code,) = python_blocks("Structured outputs: `grammar`, `response_format`")
    namespace, printed = run(code)
    person = __import__("json").loads(namespace["result"].text)
    assert set(person) == {"name", "age"} and str(person["age"]) in printed


def test_the_tool_calls_example_runs_as_written():
    from tests.conftest import _fetched_folder

    (code,) = python_blocks("Tool calls: `tools`, `tool_choice`")
    _fetched_folder("qwen2.5-coder-0.5b")  # the `draftwise models fetch` the README asks for first
    namespace, printed = run(code)
    [call] = namespace["calls"]  # one call: parallel=False
    assert call.name == "get_weather" and __import__("json").loads(call.arguments)["city"] == "Oslo"
    assert printed.startswith(f"get_weather {call.arguments}")


def test_the_own_drafter_example_runs_as_written():
    (code,) = python_blocks("Your own drafter")
    namespace, _ = run(code, reference_text="def add(a, b):\n    return a + b\n")
    result = namespace["engine"].generate("Write a function that adds two numbers.", max_new_tokens=24)
    assert result.text == namespace["plain"].generate("Write a function that adds two numbers.", max_new_tokens=24).text


def test_the_history_drafter_example_runs_as_written(capsys):
    (code,) = python_blocks("Drafting from earlier answers: `--drafter history`")
    exec(code, {})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all(" tokens a forward: " in line for line in lines)


def test_the_batch_examples_are_a_valid_batch_file_and_run_as_written(tmp_path):
    """The JSON lines the README shows for `draftwise batch` are a file it reads (checked as it
    checks every input before loading a model), and the generate_batch example runs."""
    from draftwise.server.batch_file import read_requests

    heading = "Many prompts at once: `draftwise batch` and `Engine.generate_batch`"
    section = README.read_text().split("### " + heading, 1)[1].split("\n#", 1)[0]
    (lines,) = re.findall(r"```json\n(.*?)```", section, re.S)
    source = tmp_path / "requests.jsonl"
    source.write_text(lines)
    requests = read_requests(source)
    assert [(r.custom_id, r.url) for r in requests] == [("q1", "/v1/chat/completions"), ("q2", "/v1/completions")]
    (code,) = python_blocks(heading)
    engine = draftwise.load("smollm2-135m", drafter="ngram", progress=False)
    namespace, printed = run(code, engine=engine)
    results = namespace["results"]
    assert len(results) == 3 and all(result.text for result in results)
    assert printed.strip() == str([result.text for result in results])


def test_the_openai_client_example_runs_against_draftwise_serve():
    (code,) = python_blocks("Serving: `draftwise serve`")
    assert "http://127.0.0.1:8000/v1" in code  # the port the README's `draftwise serve` line listens on
    engine = draftwise.load("smollm2-135m", drafter="ngram", progress=False)
    with ServerThread(engine, max_batch=2) as server:
        namespace, printed = run(code.replace("http://127.0.0.1:8000", server.url))
    content = namespace["reply"].choices[0].message.content
    assert content and content in printed
    assert "mean_accepted_length" in printed  # usage.speculative, then the streamed haiku and its usage


def command_lines() -> list[str]:
    """Every `draftwise ...` command the README and docs/ show: in their bash blocks
    (continuations joined, comments and `&&`-chained commands split off) and inline in their
    text, with a table cell's escaped alternatives (`a\\|b`) each taken."""
    text = "\n".join(path.read_text() for path in [README, *DOCS])
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                part = re.sub(r"\s#.*$", "", part).strip()
                if part.startswith("draftwise "):
                    commands.append(part)
    for inline in re.findall(r"`(draftwise [^`]+)`", text.replace("\n", " ")):
        first, *others = inline.split("\\|")
        commands.append(first)
        commands += [first.rsplit(" ", 1)[0] + " " + other.split(" ", 1)[0] for other in others]
    return commands


@pytest.mark.parametrize("command", command_lines())
def test_every_command_the_readme_shows_names_real_flags_and_choices(command):
    """A renamed flag or choice leaves the docs' commands failing for whoever copies them. A
    command named in prose without what it requires (`draftwise train --kind medusa`) is fine."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            build_parser().parse_args(shlex.split(command)[1:])
    except SystemExit:
        message = errors.getvalue().strip().splitlines()[-1]
        assert "arguments are required" in message or "expected one argument" in message, f"{command}\n{message}"


def benchmark_lines() -> list[str]:
    """Every `python benchmarks/...` command in the README's and docs/' text and bash blocks."""
    text = "\n".join(path.read_text() for path in [README, *DOCS])
    blocks = " ".join(block.replace("\\\n", " ") for block in re.findall(r"```bash\n(.*?)```", text, re.S))
    return sorted(set(re.findall(r"python (benchmarks/\S+\.py[^`\n]*)", blocks)
                      + re.findall(r"`python (benchmarks/[^`]+)`", text.replace("\n", " "))))


@pytest.mark.parametrize("command", benchmark_lines())
def test_every_benchmark_command_the_readme_shows_names_a_script_and_its_flags(command):
    """The benchmark scripts parse their flags only when run (minutes each): a flag the README
    shows must at least be one the script declares."""
    script, *arguments = shlex.split(re.sub(r"\s#.*$", "", command))
    path = README.parent / script
    assert path.is_file(), f"{script} does not exist"
    source = path.read_text()
    for flag in (argument for argument in arguments if re.fullmatch(r"--[a-z][a-z0-9-]*", argument)):
        assert f'"{flag}"' in source, f"{script} declares no {flag}"


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda path: path.name)
def test_every_link_in_the_docs_reaches_a_file_and_heading_that_exist(page):
    """The README's records moved to docs/ with links both ways: a renamed heading or file must
    not leave a link that goes nowhere."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists() or anchor and (path.suffix != ".md" or anchor not in _anchors(path)):
            broken.append(target)
    assert not broken, f"{page.name} links to what does not exist: {broken}"
