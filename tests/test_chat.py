"""`draftwise chat`: each reply is what the engine gives for the conversation so far, the
history stays within the context, and a bad turn or Ctrl-C never ends the conversation."""

from __future__ import annotations

import io

import pytest

import draftwise
from draftwise import chat
from draftwise.cli import main


@pytest.fixture(scope="module")
def plain():
    """Plain greedy decoding in the CLI's default weights and activations: what chat must say."""
    return draftwise.load("smollm2-135m", drafter="none", progress=False)


def _replies(plain, system: str | None, questions: list[str], max_new_tokens: int) -> list[str]:
    messages = [{"role": "system", "content": system}] if system else []
    replies = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        replies.append(plain.generate(messages, max_new_tokens=max_new_tokens).text)
        messages.append({"role": "assistant", "content": replies[-1]})
    return replies


def test_a_piped_conversation_replies_as_the_engine_does_to_the_whole_history(plain, monkeypatch, capsys):
    questions = ["What is the capital of France?", "And of Italy?"]
    lines = questions + ["/nonsense", "/reset", questions[0], "/exit", "never read"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    assert main(["chat", "--max-new-tokens", "24", "--system", "You answer in one sentence.", "--quiet"]) == 0
    out, err = capsys.readouterr()
    first, second = _replies(plain, "You answer in one sentence.", questions, 24)
    assert second != _replies(plain, "You answer in one sentence.", questions[1:], 24)[0]  # the history matters
    assert out == f"{first}\n{second}\n{first}\n"  # after /reset the first question is asked afresh
    assert "unknown command /nonsense" in err and "conversation forgotten" in err


def test_the_oldest_exchanges_go_when_the_history_outgrows_the_context(plain):
    conversation = chat.Conversation("Be brief.", [
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "An apple, " * 20},
        {"role": "user", "content": "Name a city."}])
    last = conversation.turns[-1]
    latest_alone = len(plain.encode(conversation.messages()[:1] + [last]))
    max_context = plain.target.model.info.max_context
    assert conversation.fit(plain, max_context - len(plain.encode(conversation.messages()))) == 0
    assert conversation.fit(plain, max_context - latest_alone) == 2
    assert conversation.turns == [last] and conversation.system == "Be brief."


def test_a_question_beyond_the_context_is_refused_and_the_conversation_goes_on(plain):
    lines = io.StringIO("word " * 9000 + "\nWhat is the capital of France?\n")
    out, err = io.StringIO(), io.StringIO()
    assert chat.run(plain, draftwise.SamplingParams(max_new_tokens=16), None, lines, out, err, interactive=False) == 0
    assert "but smollm2-135m reads at most" in err.getvalue()
    assert out.getvalue() == _replies(plain, None, ["What is the capital of France?"], 16)[0] + "\n"


class _StopAfter(io.StringIO):
    """A terminal whose user presses Ctrl-C once `writes` pieces of the reply are shown."""

    def __init__(self, writes: int) -> None:
        super().__init__()
        self.writes = writes

    def write(self, text: str) -> int:
        if self.writes == 0:
            self.writes = -1
            raise KeyboardInterrupt
        self.writes -= 1
        return super().write(text)


def test_ctrl_c_stops_a_reply_and_keeps_what_was_written(plain):
    conversation = chat.Conversation()
    out = _StopAfter(writes=2)
    chat.reply(plain, conversation, "Write a long story about a dragon.", draftwise.SamplingParams(max_new_tokens=64),
               out, io.StringIO())
    shown = out.getvalue()
    assert shown.endswith(" [stopped]\n")
    kept = conversation.turns[-1]["content"]
    assert kept and shown.startswith(kept) and len(kept) < len(plain.generate(
        [{"role": "user", "content": "Write a long story about a dragon."}], max_new_tokens=64).text)


def test_chat_drafts_with_the_shipped_eagle_head_unless_told_otherwise():
    from draftwise.cli import build_parser, chat_drafter

    assert build_parser().parse_args(["chat"]).drafter is None
    assert chat_drafter("smollm2-135m", None) == "eagle"  # a head is shipped for it
    assert chat_drafter("qwen2.5-coder-0.5b", None) == "ngram"  # none is
    assert chat_drafter("/some/model.gguf", None) == "ngram"
    assert chat_drafter("smollm2-135m", "none") == "none"
