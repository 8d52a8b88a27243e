"""PIQA (physical commonsense, 2 choices): ``{goal, sol1, sol2}`` JSONL + a labels file (0/1 per line).

Prompt (DiffuLLaMA, docs/algorithms.md#evaluation): context ``"Question: {goal}\\nAnswer: "``, choice ``" " + sol``.
"""

from __future__ import annotations

from pathlib import Path

from dlm.eval.tasks.base import MCExample, check_nonempty, has_fields, parse_label, read_labeled, read_records

NAME = "piqa"
KIND = "mc"
SUBDIR = "piqa"
EXPECTED = "JSONL records with fields goal, sol1, sol2 (+ optional 'label') and a labels file with 0/1 per line"


def _fits(path: Path) -> bool:
    return has_fields(read_records(path), "goal", "sol1", "sol2")


def load(path) -> list[MCExample]:
    data, labels_path, records, labels = read_labeled(path, NAME, _fits, EXPECTED, "valid-labels.lst")
    out = []
    for i, r in enumerate(records):
        gold = labels[i] if labels is not None else r["label"]
        out.append(MCExample(
            context=f"Question: {r['goal']}\nAnswer: ",
            choices=[" " + r["sol1"], " " + r["sol2"]],
            label=parse_label(gold, 2, f"{NAME} '{labels_path or data}' item {i + 1}"),
            id=str(r.get("id", i)),
        ))
    return check_nonempty(out, NAME, data)



