"""LAMBADA (last-word prediction), in either layout, chosen by content:

- plain text (the original release as used by DiffuLLaMA): one passage per line, the target is the last
  whitespace-separated word;
- OpenAI JSONL (detokenized, llm-foundry): ``{context, continuation}``.

Protocol (docs/algorithms.md#evaluation): generate exactly as many tokens as the target has, exact match of the stripped decoded
text against the target word. Each hit is counted once (the reference counted hits twice until mid-2025).
"""

from __future__ import annotations

from pathlib import Path

from dlm.errors import DLMError
from dlm.eval.tasks.base import GenExample, check_nonempty, find_task_files, has_fields, jsonl, read_records

NAME = "lambada"
KIND = "gen"
SUBDIR = "lambada"
EXPECTED = (
    "a plain-text file with one passage per line (target = last word) or JSONL records with fields "
    "context, continuation (OpenAI layout)"
)
# where the data comes from when no local file is given (dlm.eval.hub_data)
HUB = ("EleutherAI/lambada_openai", "default", "test")


def hub_files(records: list[dict]) -> dict[str, str]:  # {text} -> the OpenAI layout {context, continuation}
    split = (str(r["text"]).rstrip().rsplit(" ", 1) for r in records)
    return {"lambada_openai.jsonl": jsonl({"context": c, "continuation": " " + last} for c, last in split)}


def _plain_lines(path: Path) -> list[str] | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    if text.lstrip()[:1] in ("{", "["):
        return None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # A passage is a long line of several words; labels files (one integer per line) are not passages.
    if not lines or not all(len(ln.split()) >= 2 for ln in lines):
        return None
    return lines


def _fits(path: Path) -> bool:
    records = read_records(path)
    if records is not None:
        return has_fields(records, "context", "continuation")
    return _plain_lines(path) is not None


def _rank(path: Path) -> int:
    """A folder holding both layouts: the plain-text release (the DiffuLLaMA protocol) wins."""
    return 0 if read_records(path) is None else 1


def load(path) -> list[GenExample]:
    data, _ = find_task_files(path, NAME, _fits, False, EXPECTED, rank=_rank)
    records = read_records(data)
    out = []
    if records is not None:
        for i, r in enumerate(records):
            target = str(r["continuation"]).strip()
            if not target:
                raise DLMError(f"{NAME} '{data}' item {i + 1}: empty 'continuation'")
            out.append(GenExample(prompt=str(r["context"]).rstrip(), target=target, id=str(i)))
    else:
        for i, line in enumerate(_plain_lines(data)):
            words = line.split()
            out.append(GenExample(prompt=" ".join(words[:-1]), target=words[-1], id=str(i)))
    return check_nonempty(out, NAME, data)
