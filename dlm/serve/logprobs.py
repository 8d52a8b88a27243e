"""Token log-probabilities in the OpenAI shapes: the engine's :class:`~dlm.decode.sampling.TokenLogprob` (ids and
numbers) turned into token texts, text offsets and the ``logprobs`` objects of completions
(``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``) and chat completions (``content``: token,
logprob, bytes, top_logprobs).

A token's *piece* is what it adds to the decoded text after the tokens before it (decoded with a few tokens of
context, so a SentencePiece word's leading space and a character split over several byte tokens come out right:
a token that ends inside a multi-byte character adds nothing, the token that completes it adds the character).
The pieces of an answer add up to its text, and each token's ``text_offset`` is where its piece starts. A token
is *shown* as its piece, or - where it adds no text (a special token, part of a character) - as its vocabulary
entry (``<|im_end|>``, ``<0xE2>``), so that distinct tokens do not look alike; its ``bytes`` are its own bytes.
Every generated token has its entry, the stop token and a stop string's tokens included (as vLLM answers: a client
such as lm-evaluation-harness counts on one entry per generated token after the echoed prompt).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

CONTEXT = 6  # tokens of context decoded before each token (enough for any merge a detokenizer makes)
NEG_INF = -9999.0  # JSON has no -inf: a token of probability 0 gets this (as vLLM does)
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback tokens


def finite(x: float) -> float:
    return x if math.isfinite(x) else NEG_INF


@lru_cache(maxsize=1)
def _byte_level() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's: each byte as a printable character) -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


@dataclass
class Alt:
    """A token as an answer shows it: its text, log-probability and bytes."""

    text: str
    logprob: float
    raw: bytes


@dataclass
class Scored:
    """One token of an answer: as shown (:class:`Alt`; ``logprob`` None for the prompt's first token, which has no
    context), where its piece starts in the answer's text and how long it is, and the most likely tokens there."""

    token: Alt
    offset: int
    width: int
    logprob: float | None
    top: list[Alt] = field(default_factory=list)


class Scorer:
    """Turns a sequence's tokens with their log-probabilities into :class:`Scored` entries, token by token
    (streams feed it as tokens arrive). ``skip_special``: special tokens add no text (as in the answer's text);
    ``offset``: where the first token's piece starts."""

    def __init__(self, tokenizer: Any, skip_special: bool = True, offset: int = 0):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        self.offset = offset
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = "ByteLevel" in repr(decoder)  # vocabulary entries spell bytes as GPT-2's alphabet

    def _text(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)
        return text.rstrip("\ufffd")  # an unfinished multi-byte character: added by the token that finishes it

    def pieces(self, tokens: list[int]) -> list[str]:
        """What each of ``tokens`` would add after the sequence so far (the chosen token and its alternatives)."""
        ctx = self.ids[-CONTEXT:]
        head = self._text(ctx)
        out = []
        for t in tokens:
            full = self._text(ctx + [t])
            out.append(full[len(head) :] if full.startswith(head) else self._text([t]))
        return out

    def shown(self, token: int, piece: str, logprob: float) -> Alt:
        """The token as an answer shows it (see the module docstring)."""
        entry = str(self.tokenizer.convert_ids_to_tokens(int(token))) if self.byte_level or not piece else ""
        m = _BYTE_TOKEN.fullmatch(entry)
        if m:
            raw = bytes([int(m.group(1), 16)])
        elif self.byte_level and entry and all(c in _byte_level() for c in entry):
            raw = bytes(_byte_level()[c] for c in entry)
        else:
            raw = (piece or entry).encode("utf-8")
        return Alt(piece or entry, logprob, raw)

    def feed(self, ids: list[int], logprobs: list | None) -> list[Scored]:
        """Entries for ``ids`` (``logprobs``: their TokenLogprob, or None entries for tokens without one)."""
        out = []
        for i, t in enumerate(ids):
            lp = None if logprobs is None else logprobs[i]
            alts = [a for a, _ in lp.top] if lp is not None else []
            texts = self.pieces([int(t), *alts])
            value = None if lp is None else finite(lp.logprob)
            top = [self.shown(a, p, finite(v)) for p, (a, v) in zip(texts[1:], lp.top)] if lp is not None else []
            token = self.shown(int(t), texts[0], 0.0 if value is None else value)
            out.append(Scored(token, self.offset, len(texts[0]), value, top))
            self.offset += len(texts[0])
            self.ids.append(int(t))
        return out


def completion_logprobs(entries: list[Scored]) -> dict[str, Any]:
    """The ``logprobs`` object of a text completion choice (OpenAI's legacy shape, as vLLM fills it: each position's
    ``top_logprobs`` holds the k most likely tokens and the chosen one)."""
    top: list[dict[str, float] | None] = []
    for e in entries:
        if e.logprob is None:
            top.append(None)
            continue
        d: dict[str, float] = {}
        for a in e.top:
            d.setdefault(a.text, a.logprob)
        d.setdefault(e.token.text, e.logprob)
        top.append(d)
    return {
        "tokens": [e.token.text for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": top,
        "text_offset": [e.offset for e in entries],
    }


def chat_logprobs(entries: list[Scored]) -> dict[str, Any]:
    """The ``logprobs`` object of a chat completion choice: per token its text, log-probability, bytes and the
    ``top_logprobs`` most likely tokens."""

    def one(a: Alt) -> dict[str, Any]:
        return {"token": a.text, "logprob": a.logprob, "bytes": list(a.raw)}

    return {"content": [{**one(e.token), "top_logprobs": [one(a) for a in e.top]} for e in entries], "refusal": None}
