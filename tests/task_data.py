"""Small evaluation and corpus files in the real benchmarks' formats, written by the tests themselves, so that every
test runs in a user's clone (no data outside the repository). The records are made up here: sentences built from
a fixed vocabulary with a seeded generator, and a few classical Chinese couplets (public domain) for the poem task.

    root = write_task_data(tmp_path)   # root/piqa, root/siqa, root/winogrande, root/hellaswag, root/lambada,
                                       # root/poem_reverse, root/corpus - the layout `dlm eval --data-dir` reads

The first record of each task is fixed (FIRST) so that tests can assert the exact prompt a loader builds; the
counts are COUNTS. A larger set of real slices may sit in ../shared/data beside a developer's checkout; the tests
that read it (``real_data``) are skipped where it is absent.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

COUNTS = {"piqa": 24, "siqa": 24, "winogrande": 24, "hellaswag": 24, "lambada": 30, "poem_reverse": 12}

FIRST = {
    "piqa": {
        "goal": "How do I keep a loaf of bread fresh for a week?",
        "sol1": "Wrap it in a cloth and keep it in a bread box.",
        "sol2": "Leave it open on a sunny window sill.",
        "label": 0,
    },
    "siqa": {
        "context": "Jordan lent Casey a coat before the long walk home.",
        "question": "What will Casey want to do next?",
        "answerA": "give the coat back later",
        "answerB": "throw the coat away",
        "answerC": "sell the coat",
        "label": "1",
    },
    "winogrande": {
        "context_options": [
            "Anna asked Beth for help with the essay because Anna",
            "Anna asked Beth for help with the essay because Beth",
        ],
        "continuation": "was the better writer.",
        "gold": 1,
    },
    "hellaswag": {
        "context": "Baking bread: A woman kneads dough on a floured table. she",
        "gold": 2,
        "endings": [
            "paints the table a bright shade of blue.",
            "throws the dough out of the window.",
            "shapes the dough into a round loaf.",
            "reads a newspaper upside down.",
        ],
    },
    "lambada": {
        "text": "the old sailor told us about the storm and the broken mast . when the sea grew calm he went back "
        "to the harbor and sat by the water . every evening he watched the boats come home , and he never "
        "again set sail on the sea",
        "openai": "The old sailor told us about the storm and the broken mast. When the sea grew calm he went back "
        "to the harbor and sat by the water. Every evening he watched the boats come home, and he never again "
        "set sail on the sea",
    },
}

# Classical couplets (Tang and earlier, public domain): first line, second line, source
POEMS = [
    ("床前明月光", "疑是地上霜", "李白•静夜思"),
    ("举头望明月", "低头思故乡", "李白•静夜思"),
    ("春眠不觉晓", "处处闻啼鸟", "孟浩然•春晓"),
    ("夜来风雨声", "花落知多少", "孟浩然•春晓"),
    ("白日依山尽", "黄河入海流", "王之涣•登鹳雀楼"),
    ("欲穷千里目", "更上一层楼", "王之涣•登鹳雀楼"),
    ("红豆生南国", "春来发几枝", "王维•相思"),
    ("愿君多采撷", "此物最相思", "王维•相思"),
    ("千山鸟飞绝", "万径人踪灭", "柳宗元•江雪"),
    ("孤舟蓑笠翁", "独钓寒江雪", "柳宗元•江雪"),
    ("离离原上草", "一岁一枯荣", "白居易•赋得古原草送别"),
    ("野火烧不尽", "春风吹又生", "白居易•赋得古原草送别"),
]

_NAMES = ["Alex", "Sam", "Robin", "Taylor", "Jamie", "Morgan", "Riley", "Avery", "Quinn", "Drew"]
_NOUNS = [
    "garden",
    "river",
    "kitchen",
    "market",
    "library",
    "bicycle",
    "lantern",
    "harbor",
    "window",
    "letter",
    "basket",
    "mountain",
    "village",
    "teacher",
    "candle",
    "ladder",
    "blanket",
    "kettle",
    "orchard",
    "bridge",
]
_VERBS = ["opens", "carries", "paints", "cleans", "finds", "repairs", "watches", "follows", "builds", "moves"]
_ADJ = ["quiet", "bright", "heavy", "narrow", "warm", "old", "green", "small", "wooden", "distant"]


def _sentence(rng: random.Random) -> str:
    return (
        f"{rng.choice(_NAMES)} {rng.choice(_VERBS)} the {rng.choice(_ADJ)} {rng.choice(_NOUNS)} "
        f"near the {rng.choice(_NOUNS)}"
    )


def _write_jsonl(path: Path, rows) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def corpus_paragraphs(n: int = 600, seed: int = 0) -> list[str]:
    """Plain-text paragraphs of 1-6 sentences (the corpus file holds them separated by blank lines)."""
    rng = random.Random(seed)
    return [". ".join(_sentence(rng).capitalize() for _ in range(rng.randint(1, 6))) + "." for _ in range(n)]


def write_task_data(root: str | Path, seed: int = 0) -> Path:
    """Every task's files under ``root`` in the layouts of the real releases (see the module's docstring)."""
    root = Path(root)
    rng = random.Random(seed)
    for d in ("piqa", "siqa", "winogrande", "hellaswag", "lambada", "poem_reverse", "corpus"):
        (root / d).mkdir(parents=True, exist_ok=True)

    # PIQA: {goal, sol1, sol2} per line, a label 0/1 per line in a separate file
    f = FIRST["piqa"]
    piqa = [{k: f[k] for k in ("goal", "sol1", "sol2")}]
    labels = [f["label"]]
    for _ in range(COUNTS["piqa"] - 1):
        piqa.append(
            {"goal": f"How do I {_sentence(rng).lower()}?", "sol1": _sentence(rng) + ".", "sol2": _sentence(rng) + "."}
        )
        labels.append(rng.randint(0, 1))
    _write_jsonl(root / "piqa" / "valid.jsonl", piqa)
    (root / "piqa" / "valid-labels.lst").write_text("".join(f"{x}\n" for x in labels))

    # Social IQa: {context, question, answerA-C}, labels "1".."3"
    f = FIRST["siqa"]
    siqa = [{k: f[k] for k in ("context", "question", "answerA", "answerB", "answerC")}]
    labels = [f["label"]]
    for _ in range(COUNTS["siqa"] - 1):
        siqa.append(
            {
                "context": _sentence(rng) + ".",
                "question": "What will happen next?",
                **{f"answer{c}": _sentence(rng) for c in "ABC"},
            }
        )
        labels.append(str(rng.randint(1, 3)))
    _write_jsonl(root / "siqa" / "dev.jsonl", siqa)
    (root / "siqa" / "dev-labels.lst").write_text("".join(f"{x}\n" for x in labels))

    # WinoGrande, MosaicML's layout: {context_options[2], continuation, gold}; the release's labels 1/2 beside it
    wino = [FIRST["winogrande"]]
    for _ in range(COUNTS["winogrande"] - 1):
        a, b = rng.sample(_NAMES, 2)
        stem = f"{a} thanked {b} for the {rng.choice(_NOUNS)} because"
        wino.append(
            {"context_options": [f"{stem} {a}", f"{stem} {b}"], "continuation": "was kind.", "gold": rng.randint(0, 1)}
        )
    _write_jsonl(root / "winogrande" / "winogrande.jsonl", wino)
    (root / "winogrande" / "dev-labels.lst").write_text("".join(f"{w['gold'] + 1}\n" for w in wino))

    # HellaSwag as text: 6 lines per task - context (activity label + ": " + ctx), gold index, four endings
    f = FIRST["hellaswag"]
    lines = [f["context"], str(f["gold"]), *f["endings"]]
    for _ in range(COUNTS["hellaswag"] - 1):
        lines += [f"Housework: {_sentence(rng)}. they", str(rng.randint(0, 3))]
        lines += [f"{rng.choice(_VERBS)} the {rng.choice(_NOUNS)}." for _ in range(4)]
    (root / "hellaswag" / "hellaswag_val.txt").write_text("\n".join(lines) + "\n")

    # LAMBADA: the plain-text release (lower-cased, space-tokenized, target = last word) and OpenAI's JSONL
    plain, openai = [FIRST["lambada"]["text"]], [FIRST["lambada"]["openai"]]
    for _ in range(COUNTS["lambada"] - 1):
        words = " . ".join(_sentence(rng).lower() for _ in range(4)).split()
        plain.append(" ".join(words))
        openai.append(". ".join(_sentence(rng) for _ in range(4)))
    (root / "lambada" / "lambada_test_plain_text.txt").write_text("\n".join(plain) + "\n")
    _write_jsonl(
        root / "lambada" / "lambada_openai.jsonl",
        [{"context": t.rsplit(" ", 1)[0], "continuation": " " + t.rsplit(" ", 1)[1]} for t in openai],
    )

    # poem reversal: a JSON list of {first, second, source}
    poems = [{"first": a, "second": b, "source": s} for a, b, s in POEMS[: COUNTS["poem_reverse"]]]
    (root / "poem_reverse" / "poem_data.json").write_text(json.dumps(poems, ensure_ascii=False, indent=1))

    (root / "corpus" / "corpus.txt").write_text("\n\n".join(corpus_paragraphs(seed=seed)) + "\n")
    return root
