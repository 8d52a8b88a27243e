"""Benchmark tasks, one module per benchmark; :data:`TASKS` maps the task name to its module.

Each module has ``NAME``, ``KIND`` ("mc" | "gen" | "isd": drafting quality), ``SUBDIR`` (its folder inside
``--data-dir``) and ``load(path, ...)`` returning :class:`~dlm.eval.tasks.base.MCExample` or
:class:`~dlm.eval.tasks.base.GenExample`; a module with ``BUILTIN = True`` loads built-in data when given none.
"""

from __future__ import annotations

from pathlib import Path

from dlm.errors import DLMError, closest
from dlm.eval.hub_data import hub_task_folder
from dlm.eval.tasks import hellaswag, isd_acceptance, lambada, piqa, poem_reverse, siqa, winogrande
from dlm.eval.tasks.base import GenExample, MCExample

TASKS = {m.NAME: m for m in (hellaswag, winogrande, piqa, siqa, lambada, poem_reverse, isd_acceptance)}
DEFAULT_TASKS = ("hellaswag", "winogrande", "piqa", "siqa")

__all__ = ["TASKS", "DEFAULT_TASKS", "MCExample", "GenExample", "parse_task_list", "task_path", "load_task"]


def parse_task_list(tasks) -> list[str]:
    """'piqa,siqa' or ['piqa', 'siqa'] -> validated list of task names."""
    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t and t.strip()]
    if not names:
        raise DLMError(f"--eval-tasks is empty; choose from {', '.join(TASKS)}")
    for n in names:
        if n not in TASKS:
            raise DLMError(
                f"unknown eval task '{n}' in --eval-tasks; did you mean {closest(n, TASKS)}? "
                f"(tasks: {', '.join(TASKS)})"
            )
    return names


def path_flag(name: str) -> str:
    """The `dlm eval` flag that gives task ``name`` a file or folder (a module's PATH_FLAG where it is shorter)."""
    return getattr(TASKS[name], "PATH_FLAG", f"--{name.replace('_', '-')}-path")


def task_path(name: str, data_dir=None, paths: dict | None = None) -> Path:
    """Where task ``name`` reads from: an explicit per-task path, else ``data_dir/<task folder>``, else the task's
    hub source (dlm.eval.hub_data)."""
    flag = path_flag(name)
    if paths and paths.get(name):
        return Path(paths[name]).expanduser()
    if data_dir is None:
        if getattr(TASKS[name], "HUB", None):  # the split lm-evaluation-harness scores, from the hub
            return hub_task_folder(TASKS[name])
        raise DLMError(f"no data for task '{name}': pass --data-dir DIR (with DIR/{TASKS[name].SUBDIR}/...) or {flag}")
    folder = Path(data_dir).expanduser()
    if not folder.is_dir():
        raise DLMError(f"--data-dir '{folder}' is not a folder")
    sub = folder / TASKS[name].SUBDIR
    if not sub.exists():
        raise DLMError(
            f"no '{TASKS[name].SUBDIR}' folder in --data-dir '{folder}' for task '{name}'; add it or pass {flag}"
        )
    return sub


def load_task(name: str, data_dir=None, paths: dict | None = None, **options) -> list:
    """The examples of task ``name`` (``options`` go to the task's loader, e.g. direction= for poem_reverse)."""
    module = TASKS[name]
    if (
        getattr(module, "BUILTIN", False)
        and not (paths and paths.get(name))
        and (data_dir is None or not (Path(data_dir).expanduser() / module.SUBDIR).exists())
    ):
        return module.load(None, **options)  # a task with built-in data (isd_acceptance) needs no files
    return module.load(task_path(name, data_dir, paths), **options)
