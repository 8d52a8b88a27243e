"""WinoGrande (2 choices), in either layout, chosen by content:

- original release: ``{sentence, option1, option2, answer}`` JSONL, ``answer`` "1"/"2" (empty on the test split),
  optionally with a labels file (1/2 per line) beside it;
- MosaicML (llm-foundry): ``{context_options: [a, b], continuation, gold}`` with ``gold`` 0/1.

Prompt (DiffuLLaMA, docs/algorithms.md#evaluation): split the sentence at "_"; context = the text before it; each choice =
option + the rest of the sentence. The MosaicML layout stores ``context_options[i] = text before "_" + option_i``;
the split point is recovered as the last word boundary before the two options differ, so the shared words of the
two contexts become the context (a word both options share, like "the", is then context instead of choice; for the
exact log-likelihood that changes no prediction).
"""

from __future__ import annotations

import os
from pathlib import Path

from dlm.errors import DLMError
from dlm.eval.tasks.base import (
    MCExample,
    check_nonempty,
    has_fields,
    jsonl,
    parse_label,
    read_labeled,
    read_records,
)

NAME = "winogrande"
KIND = "mc"
SUBDIR = "winogrande"
EXPECTED = (
    "JSONL records with fields sentence, option1, option2, answer (original release, labels in 'answer' or "
    "a labels file with 1/2 per line) or context_options, continuation, gold (MosaicML layout)"
)
# where the data comes from when no local file is given (dlm.eval.hub_data)
HUB = ("allenai/winogrande", "winogrande_xl", "validation")


def hub_files(records: list[dict]) -> dict[str, str]:  # the original layout, its answer "1"/"2" in each record
    return {"dev.jsonl": jsonl(records, ("sentence", "option1", "option2", "answer"))}


def _layout(records) -> str | None:
    if has_fields(records, "sentence", "option1", "option2"):
        return "original"
    if has_fields(records, "context_options", "continuation", "gold"):
        return "mosaicml"
    return None


def _fits(path: Path) -> bool:
    return _layout(read_records(path)) is not None


def _split_options(a: str, b: str) -> tuple[str, str, str]:
    """('... so Sarah', '... so Maria') -> ('... so ', 'Sarah', 'Maria'), cutting at a word boundary."""
    common = os.path.commonprefix([a, b])
    cut = common.rfind(" ") + 1
    return a[:cut], a[cut:], b[cut:]


def load(path) -> list[MCExample]:
    data, labels_path, records, labels = read_labeled(path, NAME, _fits, EXPECTED)
    layout = _layout(records)
    out = []
    for i, r in enumerate(records):
        where = f"{NAME} '{data}' item {i + 1}"
        if layout == "original":
            sentence = r["sentence"]
            if "_" not in sentence:
                raise DLMError(f"{where}: the sentence has no '_' blank to fill: {sentence!r}")
            idx = sentence.index("_")
            context, rest = sentence[:idx], sentence[idx + 1 :]
            choices = [r["option1"] + rest, r["option2"] + rest]
            gold = r.get("answer", "")
            if labels is not None:
                gold = labels[i]
            if gold in ("", None):
                raise DLMError(
                    f"{where}: no answer (test split?) and no labels file beside '{data}'; use the "
                    f"validation split or add its labels file (1/2 per line)"
                )
            label = parse_label(gold, 2, where, one_based=True)
        else:
            opts = r["context_options"]
            if not isinstance(opts, list) or len(opts) != 2:
                raise DLMError(f"{where}: 'context_options' must be a list of 2 strings")
            context, a, b = _split_options(opts[0], opts[1])
            cont = r["continuation"]
            sep = "" if cont[:1].isspace() or cont[:1] in ",.;:!?'" else " "
            choices = [a + sep + cont, b + sep + cont]
            label = parse_label(r["gold"], 2, where)
            if (
                labels is not None
                and parse_label(labels[i], 2, f"{NAME} '{labels_path}' item {i + 1}", one_based=True) != label
            ):
                raise DLMError(
                    f"{NAME}: '{labels_path}' line {i + 1} disagrees with 'gold' of '{data}' item "
                    f"{i + 1}; the labels file belongs to another split - remove or replace it"
                )
        out.append(MCExample(context=context, choices=choices, label=label, id=str(r.get("qID", i))))
    return check_nonempty(out, NAME, data)
