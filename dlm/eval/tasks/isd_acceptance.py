"""Drafting quality of an I-DLM: greedy Introspective Strided Decoding on chat prompts.

What it measures (docs/algorithms.md#isd): per draft position, the share of drafts the verify step accepted; tokens per
forward (TPF); and whether the ISD output equals the model's own greedy AR output on every prompt (it must, for
any I-DLM; with gated LoRA the AR output is the base model's). ``acc`` is the first draft position's acceptance,
the figure that sets the speed of the N=2 decoder (TPF = 2 / (2 - a) in the long run).

Data, chosen by content:

- a JSONL file of chat records (``messages``: the first user message is the prompt), the layout ``dlm train``
  reads, so a held-out split of one's own training data works as is;
- a JSONL file with a string field ``prompt`` (the ``dlm generate --prompts-file`` layout);
- plain text, one prompt per line.

Without a file (no ``--data-dir`` folder ``isd_acceptance/`` and no ``--isd-acceptance-path``) it runs on dlm's
built-in held-out instructions (20 topics x 16 templates, topics that no built-in training instruction uses;
``dlm quickstart`` measures on the same ones). Every prompt is sent as a user chat message when the tokenizer has
a chat template; each generates up to :data:`GEN_LENGTH` tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from dlm.data.distill import builtin_instructions
from dlm.errors import DLMError
from dlm.eval.tasks.base import GenExample, check_nonempty, find_task_files

NAME = "isd_acceptance"
KIND = "isd"
SUBDIR = "isd_acceptance"
BUILTIN = True  # runs on the built-in held-out instructions when no data is given
EXPECTED = (
    "JSONL chat records (field messages with a user turn), JSONL with a string field prompt, or plain text "
    "with one prompt per line"
)
GEN_LENGTH = 64


def _prompt_of(rec: dict) -> str | None:
    if isinstance(rec.get("prompt"), str):
        return rec["prompt"]
    msgs = rec.get("messages")
    if isinstance(msgs, list):
        for m in msgs:
            if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str):
                return m["content"]
    return None


def _read(path: Path) -> list[str] | None:
    """The prompts of ``path`` in any of the layouts, or None when it is in none of them."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return None
    if lines[0].lstrip().startswith("{"):
        prompts = []
        for ln in lines:
            try:
                rec = json.loads(ln)
            except json.JSONDecodeError:
                return None
            p = _prompt_of(rec) if isinstance(rec, dict) else None
            if p is None:
                return None
            prompts.append(p)
        return prompts
    if lines[0].lstrip().startswith("["):
        return None
    return [ln.strip() for ln in lines]


def load(path=None, gen_length: int = GEN_LENGTH) -> list[GenExample]:
    if path is None:
        prompts, where = builtin_instructions("heldout"), "built-in held-out instructions"
    else:
        data, _ = find_task_files(path, NAME, lambda p: _read(p) is not None, False, EXPECTED)
        prompts, where = _read(data), str(data)
        check_nonempty(prompts, NAME, data)
    if gen_length < 1:
        raise DLMError(f"{NAME}: the generation length must be >= 1, got {gen_length}")
    return [
        GenExample(prompt=p, target="", id=str(i), chat=True, max_new_tokens=gen_length, extra={"source": where})
        for i, p in enumerate(prompts)
    ]
