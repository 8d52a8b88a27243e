"""PIQA (physical commonsense, 2 choices): ``{goal, sol1, sol2}`` JSONL + a labels file (0/1 per line).

Prompt (DiffuLLaMA, docs/algorithms.md#evaluation): context ``"Question: {goal}\\nAnswer: "``, choice ``" " + sol``.
"""

from __future__ import annotations

import json

from dlm.eval.tasks.base import MCExample, load_labeled_mc

NAME = "piqa"
KIND = "mc"
SUBDIR = "piqa"
EXPECTED = "JSONL records with fields goal, sol1, sol2 (+ optional 'label') and a labels file with 0/1 per line"
# where the data comes from when no local file is given (dlm.eval.hub_data)
HUB = ("baber/piqa", "default", "validation")


def hub_files(records: list[dict]) -> dict[str, str]:
    rows = "".join(json.dumps({k: r[k] for k in ("goal", "sol1", "sol2")}) + "\n" for r in records)
    return {"valid.jsonl": rows, "valid-labels.lst": "".join(f"{int(r['label'])}\n" for r in records)}


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
