"""HellaSwag (4 endings), in either layout, chosen by content:

- original release (rowanz/hellaswag, HF ``Rowan/hellaswag``): JSONL ``{ctx_a, ctx_b, ctx, activity_label,
  endings[4], label}``;
- text layout (klosax/hellaswag_text_data): 6 lines per item - context (activity label + ": " + ctx), the gold
  index 0-3, then the four endings.

Prompt (DiffuLLaMA, docs/algorithms.md#evaluation): context = preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize()),
choice = " " + preprocess(ending) (the reference's Llama tokenizer adds that word-boundary space itself when it
encodes the ending separately); preprocess = strip, " [title]" -> ". ", drop other [..] tags, collapse double spaces.
The text layout has ctx already joined (ctx_b not capitalized); it is preprocessed the same way.
"""

from __future__ import annotations

import re
from pathlib import Path

from dlm.errors import DLMError
from dlm.eval.tasks.base import (
    MCExample,
    check_nonempty,
    find_task_files,
    has_fields,
    jsonl,
    parse_label,
    read_records,
)

NAME = "hellaswag"
KIND = "mc"
SUBDIR = "hellaswag"
EXPECTED = (
    "JSONL records with fields ctx (or ctx_a/ctx_b), activity_label, endings, label, or a text file of "
    "6 lines per item (context, gold index 0-3, four endings)"
)
# where the data comes from when no local file is given (dlm.eval.hub_data)
HUB = ("Rowan/hellaswag", "default", "validation")


def hub_files(records: list[dict]) -> dict[str, str]:  # the original release's JSONL, as it is
    return {"hellaswag_val.jsonl": jsonl(records)}


def preprocess(text: str) -> str:
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _text_items(path: Path) -> list[list[str]] | None:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (UnicodeDecodeError, OSError):
        return None
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines or len(lines) % 6 != 0:
        return None
    items = [lines[i : i + 6] for i in range(0, len(lines), 6)]
    if not all(re.fullmatch(r"\s*\d+\s*", item[1]) for item in items):
        return None
    return items


def _fits(path: Path) -> bool:
    records = read_records(path)
    if records is not None:
        return has_fields(records, "endings") and ("ctx" in records[0] or "ctx_a" in records[0])
    return _text_items(path) is not None


def load(path) -> list[MCExample]:
    data, _ = find_task_files(path, NAME, _fits, False, EXPECTED)
    records = read_records(data)
    out = []
    if records is not None:
        for i, r in enumerate(records):
            where = f"{NAME} '{data}' item {i + 1}"
            if "ctx_a" in r:
                ctx = r["ctx_a"] + " " + r.get("ctx_b", "").capitalize()
            else:
                ctx = r["ctx"]
            endings = r["endings"]
            if not isinstance(endings, list) or len(endings) < 2:
                raise DLMError(f"{where}: 'endings' must be a list of the candidate endings")
            if r.get("label", "") in ("", None):
                raise DLMError(f"{where}: no 'label' (test split?); use the validation split")
            out.append(
                MCExample(
                    context=preprocess(r.get("activity_label", "") + ": " + ctx),
                    choices=[" " + preprocess(e) for e in endings],
                    label=parse_label(r["label"], len(endings), where),
                    id=str(r.get("ind", i)),
                )
            )
    else:
        for i, item in enumerate(_text_items(data)):
            out.append(
                MCExample(
                    context=preprocess(item[0]),
                    choices=[" " + preprocess(e) for e in item[2:6]],
                    label=parse_label(item[1], 4, f"{NAME} '{data}' item {i + 1}"),
                    id=str(i),
                )
            )
    return check_nonempty(out, NAME, data)
