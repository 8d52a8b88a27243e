"""Social IQa (3 choices): ``{context, question, answerA, answerB, answerC}`` JSONL + labels file ("1"/"2"/"3").

Prompt (DiffuLLaMA, docs/algorithms.md#evaluation): context ``"Question: {context} {question}\\nAnswer: "``, choice = the answer.
"""

from __future__ import annotations

from dlm.eval.tasks.base import MCExample, jsonl, labels_text, load_labeled_mc

NAME = "siqa"
KIND = "mc"
SUBDIR = "siqa"
EXPECTED = (
    "JSONL records with fields context, question, answerA, answerB, answerC (+ optional 'label') and a "
    "labels file with 1/2/3 per line"
)
# where the data comes from when no local file is given (dlm.eval.hub_data)
HUB = ("allenai/social_i_qa", "default", "validation")


def hub_files(records: list[dict]) -> dict[str, str]:
    rows = jsonl(records, ("context", "question", "answerA", "answerB", "answerC"))
    return {"dev.jsonl": rows, "dev-labels.lst": labels_text(str(r["label"]).strip() for r in records)}


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
