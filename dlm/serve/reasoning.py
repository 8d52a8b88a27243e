"""Reasoning in a chat answer: the ``<think>`` ... ``</think>`` part of a thinking model's answer (Qwen3 and the
DLMs built on it - SDAR, I-DLM -, DeepSeek-R1 and its distillations), sent as ``reasoning_content`` (vLLM's field)
apart from the ``content``.

A model opens the block itself (Qwen3: the answer starts with ``<think>``) or its chat template opens it at the end
of the prompt (DeepSeek-R1, Qwen3's thinking-only releases: the answer starts inside it); the request's prompt says
which (:func:`opens_in_prompt`). Text up to ``</think>`` is reasoning, the rest (the whitespace right after the tag
left out) is content; an answer that does not start with ``<think>`` is all content; a block the end of the answer
leaves open (``max_tokens``) is all reasoning. The content then goes on to the tool-call reader
(:mod:`dlm.serve.tool_calls`), so a call the model only thinks about is not a call.

Reasoning adds the piece ``("reasoning", text)`` to the readers' pieces.
"""

from __future__ import annotations

from typing import Any

from dlm.errors import DLMError
from dlm.serve.streaming import held
from dlm.serve.tool_calls import Piece, Reader

PARSERS = ("think",)
CHOICES = ("auto", "none", *PARSERS)  # --reasoning-parser
OPEN, CLOSE = "<think>", "</think>"


def detect(tokenizer: Any) -> str | None:
    """``"think"`` where the chat template of ``tokenizer`` writes a ``<think>`` block, else None."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(t for t in template.values() if isinstance(t, str))
    return "think" if isinstance(template, str) and OPEN in template else None


def tags_are_tokens(tokenizer: Any) -> bool:
    """Whether ``<think>`` and ``</think>`` are one token each in ``tokenizer``'s vocabulary (a structured output
    can then start after the reasoning block; otherwise it constrains the whole answer)."""
    # torch: the server's settings import this module before any model is loaded
    from dlm.decode.structured import thinking_tokens

    try:
        thinking_tokens(tokenizer)
    except DLMError:
        return False
    return True


def opens_in_prompt(prompt_text: str) -> bool:
    """Whether the chat template left the prompt inside an open ``<think>`` block (the answer starts reasoning)."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


class Thinking(Reader):
    """Splits reasoning from content; see the module docstring. ``then``: the reader the content goes to (tool
    calls), or None (the content as it is)."""

    def __init__(self, inside: bool, then: Reader | None = None):
        self.state = "inside" if inside else "start"  # start -> inside -> after, or start -> after
        self.buf = ""
        self.then = then
        self.trim = False  # right after the closing tag: its whitespace is not content

    def _content(self, text: str) -> list[Piece]:
        if not text:
            return []
        return self.then.feed(text) if self.then is not None else [("content", text)]

    def feed(self, text: str) -> list[Piece]:
        if self.state == "after" and not self.trim:
            return self._content(text)
        self.buf += text
        out: list[Piece] = []
        if self.state == "start":
            head = self.buf.lstrip()
            if not head or OPEN.startswith(head):
                return out  # may still open the block
            if not head.startswith(OPEN):
                self.state, buf, self.buf = "after", self.buf, ""
                return self._content(buf)  # no block: nothing to trim
            self.state, self.buf = "inside", head[len(OPEN) :]
        if self.state == "inside":
            end = self.buf.find(CLOSE)
            if end < 0:
                keep = held(self.buf, CLOSE)
                thought, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
                return out + ([("reasoning", thought)] if thought else [])
            if end:
                out.append(("reasoning", self.buf[:end]))
            self.state, self.buf, self.trim = "after", self.buf[end + len(CLOSE) :], True
        rest, self.buf = self.buf.lstrip(), ""  # the whitespace after the tag is not content
        if rest:
            self.trim = False
            out += self._content(rest)
        return out

    def finish(self) -> list[Piece]:
        buf, self.buf = self.buf, ""
        if self.state == "inside":
            out: list[Piece] = [("reasoning", buf)] if buf else []
        elif self.state == "start":  # nothing but whitespace or the start of the tag
            out = self._content(buf)
        else:
            out = []  # whitespace after the tag
        return out + (self.then.finish() if self.then is not None else [])
