"""Poem reversal (LLaDA's reversal-curse test on Chinese couplets): a JSON list of ``{first, second, source}``.

``direction="ftb"`` asks for the line after ``first`` (target ``second``), ``"btf"`` for the line before
``second`` (target ``first``). The prompt is LLaDA's ("{line}的下一句是什么？直接输出句子即可。" /
"{line}的上一句是什么？直接输出句子即可。") sent as a user chat message when the tokenizer has a chat template;
28 generated tokens; a hit when the target occurs in the decoded output (substring match).
"""

from __future__ import annotations

from pathlib import Path

from dlm.errors import DLMError
from dlm.eval.tasks.base import GenExample, check_nonempty, find_task_files, has_fields, read_records

NAME = "poem_reverse"
KIND = "gen"
SUBDIR = "poem_reverse"
PATH_FLAG = "--poem-path"  # dlm eval's flag for this task's file (no hub source: LLaDA's own file)
EXPECTED = "a JSON list (or JSONL) of records with fields first, second"
DIRECTIONS = ("ftb", "btf")
GEN_LENGTH = 28


def _fits(path: Path) -> bool:
    return has_fields(read_records(path), "first", "second")


def load(path, direction: str = "ftb", gen_length: int = GEN_LENGTH) -> list[GenExample]:
    if direction not in DIRECTIONS:
        raise DLMError(
            f"--poem-direction must be one of {', '.join(DIRECTIONS)} (ftb: next line, btf: previous "
            f"line), got '{direction}'"
        )
    data, _ = find_task_files(path, NAME, _fits, False, EXPECTED)
    out = []
    for i, r in enumerate(read_records(data)):
        first, second = str(r["first"]).strip(), str(r["second"]).strip()
        if direction == "ftb":
            prompt, target = f"{first}的下一句是什么？直接输出句子即可。", second
        else:
            prompt, target = f"{second}的上一句是什么？直接输出句子即可。", first
        out.append(
            GenExample(
                prompt=prompt,
                target=target,
                id=str(i),
                chat=True,
                max_new_tokens=gen_length,
                extra={"direction": direction},
            )
        )
    return check_nonempty(out, NAME, data)
