"""Social IQa (3 choices): ``{context, question, answerA, answerB, answerC}`` JSONL + labels file ("1"/"2"/"3").

Prompt (DiffuLLaMA, SPEC section 6): context ``"Question: {context} {question}\\nAnswer: "``, choice = the answer.
"""

from __future__ import annotations

from pathlib import Path

from dlm.errors import DLMError
from dlm.eval.tasks.base import MCExample, check_nonempty, find_task_files, has_fields, parse_label, read_labels, \
    read_records

NAME = "siqa"
KIND = "mc"
SUBDIR = "siqa"
EXPECTED = ("JSONL records with fields context, question, answerA, answerB, answerC (+ optional 'label') and a "
            "labels file with 1/2/3 per line")


def _fits(path: Path) -> bool:
    return has_fields(read_records(path), "context", "question", "answerA", "answerB", "answerC")


def load(path) -> list[MCExample]:
    data, labels_path = find_task_files(path, NAME, _fits, None, EXPECTED)
    records = read_records(data)
    labels = read_labels(labels_path) if labels_path else None
    if labels is None and not all("label" in r for r in records):
        raise DLMError(f"{NAME}: '{data}' has no 'label' field and no labels file was found beside it; "
                       f"put the labels file (e.g. dev-labels.lst) next to it")
    if labels is not None and len(labels) != len(records):
        raise DLMError(f"{NAME}: '{labels_path}' has {len(labels)} labels but '{data}' has {len(records)} "
                       f"records; use the labels file of the same split")
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
