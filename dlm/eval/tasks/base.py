"""What every benchmark task shares: example types, file sniffing, labels files and the error messages.

A task module (one per benchmark, in this package) defines ``NAME``, ``KIND`` (``"mc"`` multiple choice or
``"gen"`` generation), ``SUBDIR`` (the folder looked up inside ``--data-dir``) and ``load(path, **options) ->
list[example]``. Loaders choose a layout by the *content* of a file (the fields of its first record, the shape of
its lines), never by its file name; a folder is searched for the files whose content fits.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlm.errors import DLMError


@dataclass
class MCExample:
    """One multiple-choice item: score ``context + choices[i]`` for each i; ``label`` is the gold index."""

    context: str
    choices: list[str]
    label: int
    id: str = ""


@dataclass
class GenExample:
    """One generation item: ``prompt`` (text, or chat messages when ``chat``) and the ``target`` to match."""

    prompt: str
    target: str
    id: str = ""
    chat: bool = False
    # Tokens to generate; None = as many as the target has (LAMBADA) - resolved by the generation task.
    max_new_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# -- reading -------------------------------------------------------------------------------------------------------
def read_records(path: Path) -> list[dict] | None:
    """The records of a JSON-lines file or a JSON array of objects; None when the file is neither."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None
    except OSError as e:
        raise DLMError(f"cannot read '{path}': {e}") from e
    stripped = text.lstrip()
    if not stripped:
        return []
    if stripped[0] == "[":
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError:
            return None
        if isinstance(data, list) and all(isinstance(r, dict) for r in data):
            return data
        return None
    if stripped[0] != "{":
        return None
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if not records:  # one pretty-printed JSON object is not a JSONL task file
                return None
            raise DLMError(f"'{path}' line {n} is not valid JSON; fix or remove that line") from None
        if not isinstance(rec, dict):
            raise DLMError(f"'{path}' line {n} is not a JSON object")
        records.append(rec)
    return records


def jsonl(records: Iterable[dict], fields: tuple[str, ...] | None = None) -> str:
    """``records`` as JSONL text (only ``fields`` of each, where given): what :func:`read_records` reads back."""
    return "".join(json.dumps(r if fields is None else {k: r[k] for k in fields}) + "\n" for r in records)


def labels_text(labels: Iterable) -> str:
    """A labels file's text: one label per line."""
    return "".join(f"{x}\n" for x in labels)


def read_labels(path: Path) -> list[str] | None:
    """The lines of a labels file (one small integer per line), or None when the file is not one."""
    try:
        lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    except (UnicodeDecodeError, OSError):
        return None
    while lines and not lines[-1]:
        lines.pop()
    if not lines or not all(re.fullmatch(r"-?\d{1,2}", ln) for ln in lines):
        return None
    return lines


def parse_label(value, n_choices: int, where: str, one_based: bool = False) -> int:
    """An int gold index in [0, n_choices) from an int or numeric string; ``one_based`` shifts 1..n to 0..n-1."""
    try:
        label = int(str(value).strip())
    except (TypeError, ValueError):
        raise DLMError(
            f"{where}: label {value!r} is not an integer; labels must be "
            f"{'1..' + str(n_choices) if one_based else '0..' + str(n_choices - 1)}"
        ) from None
    if one_based:
        label -= 1
    if not 0 <= label < n_choices:
        shown = label + 1 if one_based else label
        valid = f"1..{n_choices}" if one_based else f"0..{n_choices - 1}"
        raise DLMError(
            f"{where}: label {shown} is out of range for {n_choices} choices (valid: {valid}); "
            f"check that the labels file belongs to this data file"
        )
    return label


def _data_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))


_SPLIT_WORDS = ("valid", "dev", "val")


def _stem_key(path: Path) -> str:
    """'valid-labels.lst' -> 'valid', 'dev.jsonl' -> 'dev': the part naming the split."""
    name = path.name.lower().split(".")[0]
    return re.sub(r"[-_]?labels?$", "", name)


def find_task_files(
    path: str | Path,
    task: str,
    fits: Callable[[Path], bool],
    needs_labels: bool | None,
    expected: str,
    rank: Callable[[Path], int] | None = None,
) -> tuple[Path, Path | None]:
    """Locate (data file, labels file or None) for ``task`` at ``path`` (a file or a folder).

    ``fits(file)`` says by content whether a file is a data file of this task. In a folder with several fitting
    files the validation split is preferred (a name containing valid/dev/val); a labels file (one integer per
    line) is paired by split name, or taken when it is the only one. ``needs_labels``: True = required,
    None = optional (used when present), False = never. ``rank(file)`` (lower = preferred) breaks ties between
    fitting files of different layouts.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise DLMError(
            f"{task}: '{path}' does not exist; pass the {task} data with --{task.replace('_', '-')}-path "
            f"FILE_OR_DIR or a --data-dir holding a '{task}' folder"
        )
    if path.is_file():
        data = path
        if not data.read_bytes().strip():
            raise DLMError(f"{task}: '{data}' is empty (no examples); point the task at a non-empty file")
        if not fits(data):
            raise DLMError(f"{task}: '{data}' is not in a known {task} layout; expected {expected}")
        folder_files = _data_files(data.parent)
    else:
        folder_files = _data_files(path)
        candidates = [p for p in folder_files if fits(p)]
        if not candidates:
            raise DLMError(f"{task}: no file in '{path}' is in a known {task} layout; expected {expected}")
        if len(candidates) > 1 and rank is not None:
            best = min(rank(p) for p in candidates)
            candidates = [p for p in candidates if rank(p) == best]
        if len(candidates) > 1:
            preferred = [p for p in candidates if any(w in p.name.lower() for w in _SPLIT_WORDS)]
            if len(preferred) == 1:
                candidates = preferred
            else:
                raise DLMError(
                    f"{task}: several {task} files in '{path}' ({', '.join(p.name for p in candidates)}); "
                    f"pass one file with --{task.replace('_', '-')}-path"
                )
        data = candidates[0]
    if needs_labels is False:
        return data, None
    label_files = [p for p in folder_files if p != data and read_labels(p) is not None]
    labels = None
    if label_files:
        same = [p for p in label_files if _stem_key(p) == _stem_key(data)]
        if len(same) == 1:
            labels = same[0]
        elif len(label_files) == 1:
            labels = label_files[0]
    if labels is None and needs_labels:
        raise DLMError(
            f"{task}: '{data}' has no labels and no labels file (one integer per line, e.g. "
            f"'{_stem_key(data)}-labels.lst') was found beside it; put the labels file in '{data.parent}'"
        )
    return data, labels


def fields_of(records: list[dict]) -> set[str]:
    return set(records[0]) if records else set()


def check_nonempty(examples: list, task: str, path: Path) -> list:
    if not examples:
        raise DLMError(f"{task}: '{path}' holds no examples; point the task at a non-empty file")
    return examples


def limit(examples: list, n: int | None) -> list:
    return examples if n is None else examples[: max(0, int(n))]


def has_fields(records: Iterable[dict] | None, *names: str) -> bool:
    if not records:
        return False
    first = next(iter(records))
    return all(n in first for n in names)


def read_labeled(
    path: str | Path, task: str, fits: Callable[[Path], bool], expected: str, labels_file_example: str | None = None
) -> tuple[Path, Path | None, list[dict], list[str] | None]:
    """``(data file, labels file or None, records, labels or None)`` of a task whose gold answers live in a
    ``label`` field or in a labels file beside the data (one per line, same order).

    With ``labels_file_example`` every record must then have a gold answer from one of the two.
    """
    data, labels_path = find_task_files(path, task, fits, None, expected)
    records = read_records(data)
    labels = read_labels(labels_path) if labels_path else None
    if labels_file_example and labels is None and not all("label" in r for r in records):
        raise DLMError(
            f"{task}: '{data}' has no 'label' field and no labels file was found beside it; "
            f"put the labels file (e.g. {labels_file_example}) next to it"
        )
    if labels is not None and len(labels) != len(records):
        raise DLMError(
            f"{task}: '{labels_path}' has {len(labels)} labels but '{data}' has {len(records)} "
            f"records; use the labels file of the same split"
        )
    return data, labels_path, records, labels


def load_labeled_mc(
    path: str | Path,
    task: str,
    fields: tuple[str, ...],
    expected: str,
    labels_file: str,
    n_choices: int,
    make: Callable[[dict], tuple[str, list[str]]],
    one_based: bool = False,
) -> list[MCExample]:
    """A multiple-choice task of JSONL records with ``fields`` and gold answers in a ``label`` field or a labels
    file (:func:`read_labeled`); ``make(record) -> (context, choices)`` is the task's prompt."""

    def fits(p: Path) -> bool:
        return has_fields(read_records(p), *fields)

    data, labels_path, records, labels = read_labeled(path, task, fits, expected, labels_file)
    out = []
    for i, r in enumerate(records):
        gold = labels[i] if labels is not None else r["label"]
        context, choices = make(r)
        out.append(
            MCExample(
                context=context,
                choices=choices,
                id=str(r.get("id", i)),
                label=parse_label(gold, n_choices, f"{task} '{labels_path or data}' item {i + 1}", one_based=one_based),
            )
        )
    return check_nonempty(out, task, data)
