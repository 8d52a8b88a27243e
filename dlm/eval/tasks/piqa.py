"""PIQA (physical commonsense, 2 choices): ``{goal, sol1, sol2}`` JSONL + a labels file (0/1 per line).

Prompt (DiffuLLaMA, docs/algorithms.md#evaluation): context ``"Question: {goal}\\nAnswer: "``, choice ``" " + sol``.
"""

from __future__ import annotations

from dlm.eval.tasks.base import MCExample, jsonl, labels_text, load_labeled_mc

NAME = "piqa"
KIND = "mc"
SUBDIR = "piqa"
EXPECTED = "JSONL records with fields goal, sol1, sol2 (+ optional 'label') and a labels file with 0/1 per line"
# where the data comes from when no local file is given (dlm.eval.hub_data)
HUB = ("baber/piqa", "default", "validation")


def hub_files(records: list[dict]) -> dict[str, str]:
    labels = labels_text(int(r["label"]) for r in records)
    return {"valid.jsonl": jsonl(records, ("goal", "sol1", "sol2")), "valid-labels.lst": labels}


def load(path) -> list[MCExample]:
    return load_labeled_mc(
        path,
        NAME,
        ("goal", "sol1", "sol2"),
        EXPECTED,
        "valid-labels.lst",
        2,
        lambda r: (f"Question: {r['goal']}\nAnswer: ", [" " + r["sol1"], " " + r["sol2"]]),
    )
