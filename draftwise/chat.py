"""`draftwise chat`: a conversation in the terminal, each reply streamed as it is decided.

The history is a list of chat messages rendered by the model's chat template every turn, so
each reply is exactly what `Engine.generate(messages)` gives for the conversation so far; with
the engine's prefix cache (`--prefix-cache-mb`, on by default) a turn prefills only what the
last turn's keys and values do not already hold: the new question. A conversation
longer than the model's context loses its oldest exchanges, said on stderr, never the system
message or the question just asked. A bad turn (a prompt the model cannot take) is reported and
the conversation goes on; Ctrl-C stops a reply, keeping what was written of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TextIO

from draftwise.config import SamplingParams
from draftwise.engine import Engine
from draftwise.errors import DraftwiseError, PromptError

COMMANDS = {"/reset": "forget the conversation (the system message stays)", "/exit": "leave (also /quit, Ctrl-D)",
            "/help": "this list"}


@dataclass(slots=True)
class Conversation:
    """The messages so far: an optional system message, then user and assistant turns."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)  # user, assistant, user, ...

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def fit(self, engine: Engine, max_new_tokens: int) -> int:
        """Drop the oldest exchanges until the rendered history leaves max_new_tokens of the
        context for the reply; the number dropped. The question just asked always stays (alone
        too long, it is Engine's PromptError; a reply with less room stops at the context's end)."""
        room = engine.target.model.info.max_context - max_new_tokens
        dropped = 0
        while len(self.turns) > 1 and len(engine.encode(self.messages())) > room:
            del self.turns[:2]  # the oldest question and its reply
            dropped += 1
        return dropped


def reply(engine: Engine, conversation: Conversation, text: str, params: SamplingParams, out: TextIO,
          err: TextIO, stats: bool = True) -> None:
    """Ask `text`, stream the reply to out and keep it in the conversation."""
    conversation.turns.append({"role": "user", "content": text})
    dropped = conversation.fit(engine, params.max_new_tokens)
    if dropped:
        print(f"(the {dropped} oldest exchange{'s' if dropped > 1 else ''} no longer fit the "
              f"{engine.target.model.info.max_context}-token context and were dropped)", file=err, flush=True)
    written, result = [], None
    try:
        for update in engine.stream(conversation.messages(), params):
            out.write(update.delta)
            out.flush()
            written.append(update.delta)
            result = update.result or result
    except KeyboardInterrupt:
        out.write(" [stopped]")
    except DraftwiseError:
        conversation.turns.pop()  # a question the model could not take is not history
        raise
    print(file=out, flush=True)
    conversation.turns.append({"role": "assistant", "content": "".join(written)})
    if stats and result is not None:
        print(result.metrics.summary(), file=err, flush=True)


def run(engine: Engine, params: SamplingParams, system: str | None, lines: TextIO, out: TextIO, err: TextIO,
        interactive: bool, stats: bool = True, drafter_name: str | None = None) -> int:
    """The conversation loop: over `lines`, or on a terminal (interactive) over input()'s lines,
    with a prompt and line editing; 0 at /exit or the end of input."""
    conversation = Conversation(system)
    if interactive:
        import readline  # noqa: F401  (input() then edits lines and keeps their history)

        drafter = f" (drafter {drafter_name})" if drafter_name else ""
        print(f"draftwise chat with {engine.target.model.info.name}{drafter}: /help for commands, Ctrl-D to leave.",
              file=err)
    while (text := _next_line(lines, out, interactive)) is not None:
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            conversation.turns.clear()
            print("(conversation forgotten)", file=err, flush=True)
        elif text == "/help":
            for command, meaning in COMMANDS.items():
                print(f"{command:8} {meaning}", file=err)
        elif text.startswith("/") and " " not in text:
            print(f"unknown command {text}: /help lists them", file=err, flush=True)
        else:
            try:
                reply(engine, conversation, text, params, out, err, stats)
            except PromptError as error:
                print(f"draftwise: {error}", file=err, flush=True)
    return 0


def _next_line(lines: TextIO, out: TextIO, interactive: bool) -> str | None:
    """The next line typed or piped, stripped ("" for a line to skip); None at the end of input."""
    if not interactive:
        line = lines.readline()
        return line.strip() if line else None
    try:
        return input(">>> ").strip()
    except EOFError:  # Ctrl-D
        print(file=out)
        return None
    except KeyboardInterrupt:  # Ctrl-C at the prompt drops the line, as Python's own prompt does
        print(file=out)
        return ""
