"""Tool calls (OpenAI's `tools`, function calling): the tools shown to the model by its own chat
template, the calls it writes read back from its text, and `tool_choice` "required" or a named
function enforced by a grammar (draftwise.structured), so the output is then always well-formed
calls of the given tools whose arguments the tool's JSON schema allows.

Tool calls are text the model writes, so speculation stays lossless with tools: the drafts are
verified as for any other text, and a grammar masks every verify row on its own path.

Format read: Hermes' (Qwen2.5, Qwen3, Hermes and the many templates that copied it), one block
per call, blocks separated by newlines:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A reply that is nothing but one such JSON object (as small Qwen models write it in "auto" mode,
without the tags, sometimes in a ```json fence) naming one of the tools is read as that call.
A block that does not hold a call stays text of the reply: nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from draftwise.errors import ConfigError

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|\Z)", re.DOTALL)
_FENCE = re.compile(r"\A```json\s*(.*?)\s*```\Z", re.DOTALL)
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str  # a JSON object, as OpenAI's function.arguments
    id: str = ""

    def openai(self, index: int | None = None) -> dict:
        """The call in OpenAI's shape (with its index, as a streamed delta carries it)."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


class ToolUse:
    """One request's tools: what its chat template is given, the grammar its tool_choice asks
    for (None: the model chooses freely), and how its calls are read back.

    tools: OpenAI's list, [{"type": "function", "function": {"name", "description", "parameters"}}];
    choice: "auto" (the model decides), "none" (no call: the tools are not shown), "required"
    (at least one call), or {"type": "function", "function": {"name": ...}} (that function);
    parallel: whether a reply may make more than one call.
    """

    def __init__(self, tokenizer, tools: list[dict], choice: str | dict = "auto", parallel: bool = True) -> None:
        self.functions = _functions(tools)
        self.named = _named_choice(choice, self.functions)
        if self.named is None and choice not in CHOICES:
            raise ConfigError(f"tool_choice {choice!r} is not one of {', '.join(CHOICES)} or "
                              '{"type": "function", "function": {"name": ...}}.')
        self.choice = "function" if self.named is not None else choice
        self.parallel = parallel and self.named is None
        if self.choice != "none":
            _check_template(tokenizer)
        self.tools = [] if self.choice == "none" else [{"type": "function", "function": f} for f in self.functions]
        self.grammar = self._grammar() if self.choice in ("required", "function") else None

    @property
    def active(self) -> bool:
        """Whether the reply is read for calls (tool_choice other than "none")."""
        return self.choice != "none"

    @property
    def stop(self) -> tuple[str, ...]:
        """Stop strings the request needs: with one call at most and no grammar to end the reply
        after it, the end of the first block (the reader takes a block the stop cut as closed)."""
        return (END,) if self.choice == "auto" and not self.parallel else ()

    def _grammar(self) -> str:
        """Lark for llguidance: one or more (or exactly one) blocks, each a JSON object naming
        a tool and arguments its schema allows. <tool_call> is one token of the vocabulary
        (an added token), referred to as such: its text spelled out would not be that token."""
        from draftwise import structured

        names = [self.named] if self.named is not None else [f["name"] for f in self.functions]
        rules = []
        for index, function in enumerate(self.functions):
            if function["name"] in names:
                schema = _call_schema(function)
                try:  # each alone first: a problem is then named by its tool
                    structured.json_schema(schema)
                except ConfigError as error:
                    raise ConfigError(f"tools[{index}].function.parameters is not a JSON schema draftwise can "
                                      f"follow: {str(error).splitlines()[0]}") from None
                rules.append(f"call_{index}: %json {json.dumps(schema)}")
        # A newline may end the reply too: Qwen2.5 writes one after a call's block and then ends,
        # and a grammar wanting another call after it made the model call on to max_tokens.
        start = 'start: call ("\\n" call)* "\\n"?' if self.parallel else 'start: call "\\n"?'
        calls = " | ".join(rule.split(":")[0] for rule in rules)
        lark = "\n".join([start, f'call: {START} "\\n" ({calls}) "\\n" {END}', *rules]) + "\n"
        return structured.lark(lark)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The reply's text outside its calls, and its calls, in order."""
        if not self.active:
            return text, []
        bare = self._bare_call(text)
        if bare is not None:
            return "", [bare]
        first = text.find(START)
        if first < 0:
            return text, []
        content, calls, position = [text[:first]], [], first
        for block in _BLOCK.finditer(text, first):
            between = text[position:block.start()]
            if between.strip():
                content.append(between)
            call = self._call(block.group(1))
            if call is None:
                content.append(block.group(0))
            else:
                calls.append(call)
            position = block.end()
        if text[position:].strip():
            content.append(text[position:])
        return "".join(content), calls

    def reader(self) -> "ToolCallReader":
        return ToolCallReader(self)

    def _call(self, body: str) -> ToolCall | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False), "call_" + uuid.uuid4().hex[:24])

    def _bare_call(self, text: str) -> ToolCall | None:
        stripped = text.strip()
        fenced = _FENCE.match(stripped)
        body = fenced.group(1) if fenced else stripped
        if not body.startswith("{"):
            return None
        call = self._call(body)
        return call if call is not None and any(f["name"] == call.name for f in self.functions) else None


class ToolCallReader:
    """Splits a streamed reply into text deltas and calls, as they become certain: text before
    the first block streams at once (but for a tail that may begin a tag); a block goes out as a
    call when it closes (or as text, if it holds no call); text between blocks streams once it
    holds more than whitespace; a reply that may be a bare call ("{" or a ```json fence first)
    is held to the end. The text deltas joined and the calls equal ToolUse.parse of the reply."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.text = ""  # the whole reply so far
        self.sent = 0  # characters of it decided (streamed as text, read as calls, or dropped)
        self.in_blocks = False  # past the first block's start
        self.between_is_text = False  # the text since the last block holds more than whitespace

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.text += delta
        if not self.use.active:
            self.sent = len(self.text)
            return delta, []
        if _may_be_bare(self.text):
            return "", []
        return self._decide(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left once the reply is complete."""
        if not self.use.active:
            return "", []
        if _may_be_bare(self.text):  # nothing was decided yet: the whole reply at once
            self.sent = len(self.text)
            return self.use.parse(self.text)
        return self._decide(final=True)

    def _decide(self, final: bool) -> tuple[str, list[ToolCall]]:
        text, calls = [], []
        while self.sent < len(self.text):
            start = self.text.find(START, self.sent)
            if start != self.sent:  # text before the next block (or after the last)
                stop = start if start >= 0 else len(self.text)
                self.between_is_text |= not self.in_blocks or bool(self.text[self.sent:stop].strip())
                if self.between_is_text:
                    end = stop if start >= 0 or final else _safe_end(self.text, self.sent)
                    text.append(self.text[self.sent:end])
                    self.sent = end
                elif start >= 0 or final:
                    self.sent = stop  # only whitespace between blocks: not text
                if start < 0:
                    break
            closing = self.text.find(END, start + len(START))
            if closing < 0 and not final:
                break
            call = self.use._call(self.text[start + len(START):closing if closing >= 0 else len(self.text)])
            stop = len(self.text) if closing < 0 else closing + len(END)
            if call is None:
                text.append(self.text[start:stop])
            else:
                calls.append(call)
            self.sent, self.in_blocks, self.between_is_text = stop, True, False
        return "".join(text), calls


def _may_be_bare(text: str) -> bool:
    """Whether the reply so far may be a bare call (a JSON object, or one in a ```json fence)."""
    stripped = text.lstrip()
    return not stripped or stripped.startswith(("{", "```json")) or "```json".startswith(stripped)


def _safe_end(text: str, start: int) -> int:
    """Where text may be streamed to: before a tail that could be the start of a block's tag."""
    for size in range(min(len(START) - 1, len(text) - start), 0, -1):
        if START.startswith(text[-size:]):
            return len(text) - size
    return len(text)


def _call_schema(function: dict) -> dict:
    """The JSON schema of one call of function: its name and arguments its parameters allow.
    The parameters' definitions move to the root, where their references ("#/$defs/...", as
    pydantic writes them) point."""
    parameters = dict(function.get("parameters") or {"type": "object"})
    definitions = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False, **definitions,
            # JSON written as the chat templates write earlier calls ({"city": "Paris"}), with no
            # room for free whitespace, where a small model can loop on newlines until max_tokens
            "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


def _functions(tools: list[dict]) -> list[dict]:
    """The tools' function definitions, checked: each a type "function" with a unique name."""
    if not isinstance(tools, list) or not tools:
        raise ConfigError("tools is a non-empty list of {\"type\": \"function\", \"function\": {\"name\": ...}}.")
    functions, seen = [], set()
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ConfigError(f"tools[{index}] is not {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}.")
        if function["name"] in seen:
            raise ConfigError(f"tools[{index}]: the name {function['name']!r} is given twice; names must be unique.")
        parameters = function.get("parameters")
        if parameters is not None and (not isinstance(parameters, dict) or parameters.get("type", "object") != "object"):
            raise ConfigError(f"tools[{index}].function.parameters is the JSON schema of the arguments, an object "
                              f'({{"type": "object", "properties": {{...}}}}), not {json.dumps(parameters)[:60]}.')
        seen.add(function["name"])
        functions.append(function)
    return functions


def _named_choice(choice, functions: list[dict]) -> str | None:
    if not isinstance(choice, dict):
        return None
    name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise ConfigError('a named tool_choice is {"type": "function", "function": {"name": ...}}.')
    if name not in {f["name"] for f in functions}:
        raise ConfigError(f"tool_choice names {name!r}, which is not among the tools "
                          f"({', '.join(f['name'] for f in functions)}).")
    return name


def _check_template(tokenizer) -> None:
    """Refuse tools a model's chat template would drop, or whose calls it writes in another format."""
    template = tokenizer.chat_template or ""
    name = getattr(tokenizer, "name_or_path", "this model")
    if "tools" not in template:
        raise ConfigError(f"the chat template of {name} has no place for tools, so the model would never see them: "
                          "use a model whose template takes tools (e.g. qwen2.5-coder-0.5b), or leave tools unset.")
    if START not in template:
        raise ConfigError(f"the chat template of {name} writes tool calls in a format draftwise does not read yet "
                          f"(it reads Hermes' {START} blocks, as Qwen2.5's template writes them).")
