"""Structured outputs: a JSON schema, any JSON object, a regular expression, one of several strings, or a Lark
grammar constrains what a request may generate.

The grammar engine is `llguidance <https://github.com/guidance-ai/llguidance>`_ (the library behind vLLM's
``guidance`` backend and llama.cpp's ``%llguidance`` grammars: a Rust lexer/parser with full JSON-schema support,
tens of microseconds per token mask, no other dependency). dlm adds what speculative decoding needs around it: a
token mask for every position of a decode chunk, each under that position's own history (the output so far plus
the chunk's earlier tokens it attends to - ISD's drafts), by consuming those tokens, computing the mask and rolling
back. The constrained distribution is then the model's with the disallowed tokens at -inf at every position; ISD
verifies its drafts against exactly that distribution, so greedy ISD equals greedy constrained AR and sampled ISD
has its distribution.

A request ends with ``finish_reason="stop"`` as soon as its grammar is complete and admits nothing more (a closed
JSON object, the last character of a choice); a grammar that may go on (``[0-9]+``) also lets the model end it
with its end-of-sequence token.
"""

from __future__ import annotations

import collections
import json
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dlm.errors import DLMError

INSTALL = "pip install llguidance (or pip install 'dlm[structured]')"
KINDS = ("json", "json_object", "regex", "choice", "grammar")
COMPILED = 64  # compiled grammars kept per tokenizer (a JSON schema compiles in about a millisecond)
MAX_AHEAD = 8  # forced tokens a decoder feeds after the pending token (or the prompt) in one forward


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match - exactly one of: ``json`` a JSON schema (a dict or its JSON text; the
    output is a JSON value valid under it), ``json_object`` any JSON object, ``regex`` a regular expression (Rust
    ``regex`` syntax, matched in full), ``choice`` one of these strings exactly, ``grammar`` a Lark grammar
    (llguidance's dialect; the start rule is ``start``). ``disable_any_whitespace``: JSON without free whitespace
    (``", "`` and ``": "`` between items; small models can otherwise loop on whitespace). vLLM's
    ``StructuredOutputsParams`` fields."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    # a thinking model's reasoning left free: "open" (the prompt opened a <think> block: the grammar starts after
    # </think>), "tags" (the answer may start with <think>: then after </think>, else at once); None: all of it
    after_thinking: str | None = None

    def __post_init__(self):
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))  # key order kept: the output follows it
        elif self.json is not None:
            if not isinstance(self.json, str):
                raise DLMError(f"a JSON schema must be a dict or its JSON text, got {type(self.json).__name__}")
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise DLMError(f"the JSON schema is not valid JSON: {e}") from e
            if not isinstance(schema, (dict, bool)):
                raise DLMError("a JSON schema must be a JSON object (or true / false)")
        if self.choice is not None:
            choice = (self.choice,) if isinstance(self.choice, str) else tuple(self.choice)
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise DLMError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", choice)
        if self.after_thinking not in (None, "open", "tags"):
            raise DLMError(f"after_thinking must be None, 'open' or 'tags', got {self.after_thinking!r}")
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise DLMError(
                f"a structured output takes exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) if given else 'none'}"
            )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def check(self) -> None:
        """DLMError naming what is wrong for an invalid schema, regex or grammar (no tokenizer needed: bad values
        fail before a model loads); DLMError with the install line without llguidance."""
        try:
            from llguidance import LLMatcher
        except ImportError as e:
            raise DLMError(f"structured outputs need the llguidance package: {INSTALL}") from e
        try:
            grammar = self.llguidance_grammar()
        except ValueError as e:
            raise DLMError(f"the {self.kind} of the structured output is invalid: {e}") from e
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
        if failed:
            raise DLMError(f"the {self.kind} of the structured output is invalid: {messages[0].strip()}")

    def llguidance_grammar(self) -> str:
        """The request as an llguidance grammar (its JSON text)."""
        from llguidance import LLMatcher

        fixed: Any = {"whitespace_flexible": False} if self.disable_any_whitespace else None  # JsonCompileOptions
        if self.json is not None:
            return LLMatcher.grammar_from_json_schema(self.json, overrides=fixed)
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=fixed)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:  # Lark string literals take JSON's escapes
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar or "")


def _unpack(bitmask: bytes, vocab: int) -> torch.Tensor:
    """llguidance's token bitmask (one bit per token, little-endian 32-bit words) -> [vocab] bool."""
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")[:vocab]
    return torch.from_numpy(bits.view(np.bool_))


class Constraint:
    """One request's grammar state: the output committed so far, consumed by an llguidance matcher.

    ``think``: ``(open, close)`` token ids of a reasoning block the grammar leaves free (``open`` None: the prompt
    opened it). The output is then in one of three states: ``start`` (it may open the block: the grammar's tokens
    and ``open`` are allowed), ``thinking`` (anything until ``close``) and ``grammar``; the tags themselves are not
    fed to the matcher."""

    def __init__(
        self, matcher: Any, vocab: int, stop_ids: Iterable[int] = (), think: tuple[int | None, int] | None = None
    ):
        self.matcher, self.vocab = matcher, vocab
        self.stop_ids = frozenset(stop_ids)
        self.think = think
        self.state = "grammar" if think is None else ("thinking" if think[0] is None else "start")

    def _after(self, state: str, tokens: Sequence[int]) -> tuple[str, list[int]]:
        """The state after ``tokens`` from ``state``, and those of them the matcher consumes."""
        if self.think is None:
            return state, [int(t) for t in tokens]
        open_id, close_id = self.think
        fed: list[int] = []
        for t in tokens:
            t = int(t)
            if state == "start":
                if t == open_id:
                    state = "thinking"
                    continue
                state = "grammar"
            elif state == "thinking":
                if t == close_id:
                    state = "grammar"
                continue
            fed.append(t)
        return state, fed

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing but the end of the sequence."""
        return self.state == "grammar" and bool(self.matcher.is_stopped())

    def add(self, tokens: Sequence[int]) -> None:
        """Committed output tokens (a stop token ends the request: it is not fed)."""
        m = self.matcher
        self.state, fed = self._after(self.state, [t for t in tokens if int(t) not in self.stop_ids])
        for t in fed:
            if not m.consume_token(t):
                raise RuntimeError(f"token {t} was committed against the request's grammar: {m.get_error()}")

    def forced(self, limit: int = MAX_AHEAD) -> list[int]:
        """The first ``limit`` tokens the grammar forces next (llguidance's fast-forward tokens: the canonical
        tokenization of the bytes it allows nothing else for), empty where it leaves a choice."""
        if self.state != "grammar":
            return []
        return [int(t) for t in self.matcher.compute_ff_tokens()[: max(limit, 0)]]

    def allowed(self, extra: Sequence[Sequence[int]], free: Iterable[int] = ()) -> torch.Tensor:
        """``[n, V]`` bool: the tokens the grammar allows at each chunk position, position j as if ``extra[j]`` (the
        chunk's tokens before it) were already in the output. A position after a token the grammar refuses allows
        everything: a decoder never commits from it (the refused token is rejected first); so do the positions in
        ``free`` and those inside a free reasoning block."""
        m = self.matcher
        out = torch.ones(len(extra), self.vocab, dtype=torch.bool)
        seen: dict[tuple[str, tuple[int, ...]], torch.Tensor | None] = {}
        skip = set(free)
        for j, ts in enumerate(extra):
            if j in skip:
                continue
            state, fed = self._after(self.state, ts)
            if state == "thinking":
                continue
            key = (state, tuple(fed))
            if key not in seen:
                k = m.try_consume_tokens(list(fed)) if fed else 0
                row = _unpack(m.compute_bitmask(), self.vocab) if k == len(fed) else None
                if k and not m.rollback(k):
                    raise RuntimeError(f"the grammar matcher could not roll back {k} tokens: {m.get_error()}")
                if row is not None and state == "start":
                    row[self.think[0]] = True  # type: ignore[index]  # or open the reasoning block
                seen[key] = row
            row = seen[key]
            if row is not None:
                out[j] = row
        return out


# llguidance's tokenizer of each Hugging Face tokenizer, by (vocabulary size, end-of-sequence ids)
_LLTOKENIZERS: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], Any]] = weakref.WeakKeyDictionary()


class GrammarBook:
    """Compiles structured outputs for one tokenizer and vocabulary (llguidance's tokenizer is built once, compiled
    grammars are kept and copied for each request)."""

    def __init__(self, tokenizer: Any, vocab: int, eos_ids: Iterable[int] = ()):
        if tokenizer is None:
            raise DLMError("structured outputs need the model's tokenizer (load the model with its tokenizer)")
        try:
            import llguidance.hf
        except ImportError as e:
            raise DLMError(f"structured outputs need the llguidance package: {INSTALL}") from e
        eos = tuple(sorted(int(t) for t in eos_ids))
        built = _LLTOKENIZERS.setdefault(tokenizer, {})
        if (vocab, eos) not in built:  # about 0.3 s for a 49k vocabulary: once per tokenizer, not per engine
            try:
                built[vocab, eos] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=list(eos) or None)
            except ValueError as e:  # a slow (Python) tokenizer
                raise DLMError(f"structured outputs need a fast (Rust) Hugging Face tokenizer: {e}") from e
        self.lltok = built[vocab, eos]
        self.vocab = vocab
        self.tokenizer = tokenizer
        self._compiled: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()  # the server validates requests on its event loop, the engine runs apart

    def matcher(self, spec: StructuredOutput):
        """A fresh matcher for ``spec`` (DLMError naming the problem for an invalid schema, regex or grammar)."""
        from llguidance import LLMatcher

        try:
            grammar = spec.llguidance_grammar()
        except ValueError as e:
            raise DLMError(f"the {spec.kind} of the structured output is invalid: {e}") from e
        with self._lock:
            template = self._compiled.get(grammar)
            if template is not None:
                self._compiled.move_to_end(grammar)
                return template.deep_copy()
        template = LLMatcher(self.lltok, grammar, log_level=0)
        if template.is_error():
            raise DLMError(f"the {spec.kind} of the structured output is invalid: {template.get_error().strip()}")
        with self._lock:
            self._compiled[grammar] = template
            while len(self._compiled) > COMPILED:
                self._compiled.popitem(last=False)
        return template.deep_copy()

    def constraint(self, spec: StructuredOutput, stop_ids: Iterable[int] = ()) -> Constraint:
        think = None
        if spec.after_thinking is not None:
            open_id, close_id = thinking_tokens(self.tokenizer)
            think = (None if spec.after_thinking == "open" else open_id, close_id)
        return Constraint(self.matcher(spec), self.vocab, stop_ids, think)


def thinking_tokens(tokenizer: Any) -> tuple[int, int]:
    """The token ids of ``<think>`` and ``</think>`` (DLMError where either is not one token of the vocabulary:
    a grammar after the reasoning block needs them whole)."""
    ids = []
    for tag in ("<think>", "</think>"):
        got = tokenizer.encode(tag, add_special_tokens=False) if tokenizer is not None else []
        if len(got) != 1:
            raise DLMError(
                f"a structured output after the reasoning needs {tag} to be one token of the vocabulary; "
                f"this tokenizer spells it {got}"
            )
        ids.append(int(got[0]))
    return ids[0], ids[1]
