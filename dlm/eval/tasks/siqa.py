"""Social IQa (3 choices): ``{context, question, answerA, answerB, answerC}`` JSONL + labels file ("1"/"2"/"3").

Prompt (DiffuLLaMA, docs/algorithms.md#evaluation): context ``"Question: {context} {question}\\nAnswer: "``, choice = the answer.
"""

from __future__ import annotations

from dlm.eval.tasks.base import MCExample, load_labeled_mc

NAME = "siqa"
KIND = "mc"
SUBDIR = "siqa"
EXPECTED = (
    "JSONL records with fields context, question, answerA, answerB, answerC (+ optional 'label') and a "
    "labels file with 1/2/3 per line"
)


def load(path) -> list[MCExample]:
    return load_labeled_mc(
        path,
        NAME,
        ("context", "question", "answerA", "answerB", "answerC"),
        EXPECTED,
        "dev-labels.lst",
        3,
        lambda r: (f"Question: {r['context']} {r['question']}\nAnswer: ", [r["answerA"], r["answerB"], r["answerC"]]),
        one_based=True,
    )
