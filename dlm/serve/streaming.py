"""Server-sent events: the ``data:`` line of one event and :class:`TextStream`, which turns a request's growing
token list into text deltas that are safe to send."""

from __future__ import annotations

import json
from typing import Any


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def held(text: str, tag: str) -> int:
    """The length of the longest tail of ``text`` that may be the start of ``tag`` (held back from a stream until
    the next text says whether ``tag`` follows)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


SSE_DONE = "data: [DONE]\n\n"  # the stream's last event (OpenAI's end marker)
SSE_KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients ignore it, a dead client's socket errors on it


class TextStream:
    """Turns a request's growing token list into text deltas that are safe to send.

    Held back: a trailing U+FFFD (a multi-byte character cut between tokens) and the longest tail that could be
    the start of a stop string (the engine stops at the full string and cuts the final text there, so text that
    may belong to a stop string is never sent early).
    """

    def __init__(self, tokenizer: Any, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0  # characters already sent

    def _hold(self, text: str) -> int:
        return max((held(text, s) for s in self.stop), default=0)

    def feed(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text: str = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        safe = len(text.rstrip("\ufffd"))
        for s in self.stop:  # a complete stop string: the engine has stopped, the text ends before it
            at = text.find(s)
            if at >= 0:
                safe = min(safe, at)
        safe -= self._hold(text[:safe])
        if safe <= self.sent:
            return ""
        delta, self.sent = text[self.sent : safe], safe
        return delta

    def finish(self, final_text: str | None) -> str:
        final_text = final_text or ""
        tail = final_text[self.sent :] if len(final_text) > self.sent else ""
        self.sent = max(self.sent, len(final_text))
        return tail
