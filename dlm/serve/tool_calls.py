"""Tool calls in a chat answer: the text the engine generates, read as OpenAI's ``content`` and ``tool_calls``.

One reader per choice turns the answer's text, fed in pieces as it streams (or whole), into pieces of the message:
``("content", text)``, ``("call", Call)`` (a call opens: its name and the arguments known so far),
``("arguments", text)`` (more arguments of the last call) and, where a reasoning reader goes first
(:mod:`dlm.serve.reasoning`), ``("reasoning", text)``. A streamed answer sends each piece as a delta; a
collected one joins them (:func:`read_all`), so both carry the same message.

What the text is depends on ``tool_choice``:

- a named function: the text *is* its arguments (constrained to its parameter schema), streamed as they come;
- ``"required"``: the text is a JSON list of ``{"name", "parameters"}`` (constrained; vLLM's shape), each call
  sent once its object is complete;
- ``"auto"``: free text in the model's own tool-call format, read by a parser named for that format
  (``dlm serve --tool-call-parser``, by default found in the chat template):

  - ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the text (Qwen2.5,
    Qwen3 and the DLMs built on them - Dream, SDAR, I-DLM -, Hermes, SmolLM3); the text around them is the content,
    whitespace next to a block dropped; a block that does not parse as a call of one of the tools stays content,
    and the last one may be left open by the end of the answer.
  - ``llama3_json``: an answer that starts with a JSON object ``{"name": ..., "parameters": {...}}`` is calls,
    several separated by ``;`` (Llama 3.1 - 3.3; its ``<|python_tag|>`` is a special token the text leaves out);
    any other answer is content.

A call of a function that is not among the request's tools is not a call: its text stays content.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlm.serve.streaming import held

PARSERS = ("hermes", "llama3_json")
CHOICES = ("auto", "none", *PARSERS)  # --tool-call-parser

_DECODER = json.JSONDecoder()


@dataclass
class Call:
    """One call: the function's name and its arguments (JSON text)."""

    name: str
    arguments: str = ""


Piece = tuple[str, Any]  # ("content", str) | ("call", Call) | ("arguments", str)


def detect(tokenizer: Any) -> str | None:
    """The tool-call format the chat template of ``tokenizer`` (or the template itself) asks the model to write in
    (one of :data:`PARSERS`), or None where it shows neither (or there is none)."""
    template = tokenizer if isinstance(tokenizer, (str, dict)) else getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the one transformers renders a request with tools in
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str):
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "Environment: ipython" in template:
        return "llama3_json"
    return None


def template_in_folder(folder: str | os.PathLike) -> str | dict | None:
    """The chat template a Hugging Face folder carries (``chat_template.jinja``, ``chat_template.json`` or
    ``tokenizer_config.json``'s field), read without loading the tokenizer; None where it has none."""
    path = Path(folder)
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        try:
            data = json.loads((path / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        template = data.get("chat_template") if isinstance(data, dict) else None
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if template:
            return template
    return None


def resolve(choice: str, tokenizer: Any, detect: Any = detect) -> str | None:
    """The parser a ``--tool-call-parser`` (or, with its ``detect``, ``--reasoning-parser``) CHOICE gives for this
    tokenizer or template: "auto" detects it, "none" is None."""
    if choice == "auto":
        return detect(tokenizer)
    return None if choice == "none" else choice


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _call(obj: Any, names: frozenset[str], args_keys: tuple[str, ...]) -> Call | None:
    """``obj`` as a call of one of ``names`` (its arguments under the first of ``args_keys`` it has), or None."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    for key in args_keys:
        if key in obj:
            value = obj[key]
            if isinstance(value, str):  # some models write the arguments as JSON text
                try:
                    value = json.loads(value)
                except ValueError:
                    return None
            return Call(obj["name"], _arguments(value)) if isinstance(value, dict) else None
    return Call(obj["name"], "{}")  # a function without parameters


def _next_call(buf: str, pos: int, separators: str, names: frozenset[str]) -> tuple[int, Call | None, int]:
    """The JSON value at ``pos`` of ``buf`` after any ``separators``: (where it starts, it as a call - None where it
    is not one -, where it ends); end -1 where no whole value is there yet."""
    while pos < len(buf) and buf[pos] in separators:
        pos += 1
    try:
        obj, end = _DECODER.raw_decode(buf, pos)
    except ValueError:
        return pos, None, -1
    return pos, _call(obj, names, ("parameters", "arguments")), end


class Reader:
    """Reads one answer; see the module docstring. ``feed`` the text as it grows, then ``finish``."""

    def feed(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def finish(self) -> list[Piece]:
        return []


class Named(Reader):
    """``tool_choice`` naming a function: the text is that function's arguments."""

    def __init__(self, name: str):
        self.name, self.opened = name, False

    def _open(self) -> list[Piece]:
        if self.opened:
            return []
        self.opened = True
        return [("call", Call(self.name))]

    def feed(self, text: str) -> list[Piece]:
        return self._open() + [("arguments", text)] if text else []

    def finish(self) -> list[Piece]:
        return self._open()


class Listed(Reader):
    """``tool_choice: "required"``: the text is a JSON list of ``{"name", "parameters"}``; each call is sent once its
    object is complete; what is left unread at the end (an answer cut short) is content."""

    def __init__(self, names: frozenset[str]):
        self.names, self.buf, self.pos = names, "", 0
        self.listed: bool | None = None  # None: not known yet; False: the text is not a list (all content)

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        if self.listed is None:
            head = self.buf.lstrip()
            if not head:
                return out
            self.listed = head[0] == "["
            self.pos = len(self.buf) - len(head) + 1 if self.listed else 0
        while self.listed:
            self.pos, call, end = _next_call(self.buf, self.pos, " \t\r\n,", self.names)
            if call is None:
                return out
            out.append(("call", call))
            self.pos = end
        return out

    def finish(self) -> list[Piece]:
        rest = self.buf[self.pos :]
        return [("content", rest)] if rest.strip() not in ("", "]") else []


class Tagged(Reader):
    """``hermes``: calls in ``<tool_call>`` ... ``</tool_call>`` blocks, content around them. Whitespace between
    content and a call is dropped; between a call and more content it stays with that content."""

    start, end = "<tool_call>", "</tool_call>"

    def __init__(self, names: frozenset[str]):
        self.names = names
        self.buf = ""  # outside a block: the held tail (whitespace, a possible start of a block); inside: the block
        self.inside = False
        self.space = ""  # whitespace not sent yet: sent with the content after it, dropped before a call
        self.scan, self.quoted, self.escaped = 0, False, False  # the open block read so far: inside a string?
        self.called = False

    def _text(self, text: str) -> list[Piece]:
        body = text.rstrip()
        if not body:
            self.space += text
            return []
        out, self.space = self.space + body, text[len(body) :]
        return [("content", out)]

    def _end(self) -> int:
        """Where the open block's closing tag starts (-1: not yet); a tag inside a JSON string (an argument that
        spells it) does not close the block."""
        buf, i = self.buf, self.scan
        while i < len(buf):
            ch = buf[i]
            if self.quoted:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.quoted = False
            elif ch == '"':
                self.quoted = True
            elif ch == "<" and buf.startswith(self.end, i):
                return i
            elif ch == "<" and self.end.startswith(buf[i:]):
                break  # the tag may be arriving: look again from here
            i += 1
        self.scan = i
        return -1

    def _block(self, body: str, closed: bool) -> list[Piece]:
        try:
            call = _call(json.loads(body), self.names, ("arguments", "parameters"))
        except ValueError:
            call = None
        if call is not None:
            self.space, self.called = "", True
            return [("call", call)]
        return self._text(self.start + body + (self.end if closed else ""))

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        while True:
            if self.inside:
                j = self._end()
                if j < 0:
                    return out
                out += self._block(self.buf[:j], closed=True)
                self.buf, self.inside = self.buf[j + len(self.end) :], False
                continue
            i = self.buf.find(self.start)
            if i >= 0:
                out += self._text(self.buf[:i])
                self.buf, self.inside = self.buf[i + len(self.start) :], True
                self.scan, self.quoted, self.escaped = 0, False, False
                continue
            hold = held(self.buf, self.start)  # a tail that may open a block
            out += self._text(self.buf[: len(self.buf) - hold])
            self.buf = self.buf[len(self.buf) - hold :]
            return out

    def finish(self) -> list[Piece]:
        buf, self.buf = self.buf, ""
        if self.inside:  # the last block left open by the end of the answer
            self.inside = False
            out = self._block(buf, closed=False)
        else:
            out = self._text(buf)
        if self.space and not self.called:  # a plain answer keeps its trailing whitespace
            out.append(("content", self.space))
        self.space = ""
        return out


class LeadingJson(Reader):
    """``llama3_json``: an answer starting with ``{`` is one or more ``{"name", "parameters"}`` objects separated by
    ``;``; any other answer is content."""

    def __init__(self, names: frozenset[str]):
        self.names = names
        self.buf = ""
        self.mode: str | None = None  # None: undecided; "content"; "calls"
        self.pos = 0

    def feed(self, text: str) -> list[Piece]:
        if self.mode == "content":
            return [("content", text)] if text else []
        self.buf += text
        if self.mode is None:
            head = self.buf.lstrip()
            if not head:
                return []
            if head[0] != "{":
                self.mode = "content"
                buf, self.buf = self.buf, ""
                return [("content", buf)]
            self.mode, self.pos = "calls", len(self.buf) - len(head)
        out: list[Piece] = []
        while True:
            self.pos, call, end = _next_call(self.buf, self.pos, " \t\r\n;", self.names)
            if end < 0:
                return out
            if call is None:  # JSON, but not a call: the rest is content
                self.mode = "content"
                rest, self.buf = self.buf[self.pos :], ""
                return out + [("content", rest)]
            out.append(("call", call))
            self.pos = end

    def finish(self) -> list[Piece]:
        calls, rest, self.buf = self.mode == "calls", self.buf[self.pos :] if self.mode == "calls" else self.buf, ""
        return [("content", rest)] if rest.strip() or (rest and not calls) else []


def reader(mode: str, names: frozenset[str]) -> Reader:
    """The reader of a chat's ``tool_choice``: ``mode`` is a parser name (``"auto"`` with that parser), ``"*"``
    (``"required"``) or ``"=NAME"`` (the function NAME by name)."""
    if mode.startswith("="):
        return Named(mode[1:])
    if mode == "*":
        return Listed(names)
    if mode == "hermes":
        return Tagged(names)
    if mode == "llama3_json":
        return LeadingJson(names)
    raise ValueError(f"unknown tool-call mode {mode!r}")


def read_all(r: Reader, text: str) -> tuple[str, list[Call], str | None]:
    """The whole answer ``text`` through ``r``: (its content, its calls, its reasoning - None: none)."""
    content: list[str] = []
    calls: list[Call] = []
    reasoning: list[str] | None = None
    for kind, value in r.feed(text) + r.finish():
        if kind == "content":
            content.append(value)
        elif kind == "reasoning":
            reasoning = (reasoning or []) + [value]
        elif kind == "call":
            calls.append(Call(value.name, value.arguments))
        else:
            calls[-1].arguments += value
    return "".join(content), calls, None if reasoning is None else "".join(reasoning)
