"""Social IQa (3 choices): ``{context, question, answerA, answerB, answerC}`` JSONL + labels file ("1"/"2"/"3").

Prompt (DiffuLLaMA, docs/algorithms.md#evaluation): context ``"Question: {context} {question}\\nAnswer: "``, choice = the answer.
"""

from __future__ import annotations

from pathlib import Path

from dlm.eval.tasks.base import MCExample, check_nonempty, has_fields, parse_label, read_labeled, read_records

NAME = "siqa"
KIND = "mc"
SUBDIR = "siqa"
EXPECTED = ("JSONL records with fields context, question, answerA, answerB, answerC (+ optional 'label') and a "
            "labels file with 1/2/3 per line")


def _fits(path: Path) -> bool:
    return has_fields(read_records(path), "context", "question", "answerA", "answerB", "answerC")


def load(path) -> list[MCExample]:
    data, labels_path, records, labels = read_labeled(path, NAME, _fits, EXPECTED, "dev-labels.lst")
    out = []
    for i, r in enumerate(records):
        gold = labels[i] if labels is not None else r["label"]
        out.append(MCExample(
            context=f"Question: {r['context']} {r['question']}\nAnswer: ",
            choices=[r["answerA"], r["answerB"], r["answerC"]],
            label=parse_label(gold, 3, f"{NAME} '{labels_path or data}' item {i + 1}", one_based=True),
            id=str(r.get("id", i)),
        ))
    return check_nonempty(out, NAME, data)
