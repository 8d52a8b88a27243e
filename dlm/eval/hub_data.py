"""Benchmark data from the Hugging Face hub, for a task given no local file (no ``--data-dir`` or ``--<task>-path``).

Each task module names its source as ``HUB = (dataset repository, config, split)`` - the split lm-evaluation-harness
scores (PIQA ``baber/piqa`` validation, Social IQa ``allenai/social_i_qa`` validation, WinoGrande
``allenai/winogrande`` ``winogrande_xl`` validation, HellaSwag ``Rowan/hellaswag`` validation, LAMBADA
``EleutherAI/lambada_openai`` test) - and a ``hub_files(records)`` that writes the records in one of the task's
local layouts. The records come from the hub's parquet export of the repository (its ``refs/convert/parquet``
branch, ``<config>/<split>/NNNN.parquet``, which every public dataset has whatever its own format), through
:func:`dlm.model.hub.snapshot`: the standard cache, ``HF_ENDPOINT``, tokens and ``HF_HUB_OFFLINE`` as for models.
The local files are written once per parquet commit under ``$DLM_HOME/data/`` and read by the task's own loader,
so hub data and local files take the same path from there on. Poem reversal has no hub source (LLaDA's file:
pass ``--poem-path``).
"""

from __future__ import annotations

from pathlib import Path

from dlm.errors import DLMError
from dlm.fsutil import atomic_folder
from dlm.model.hub import snapshot
from dlm.settings import home

PARQUET_REVISION = "refs/convert/parquet"


def hub_task_folder(module) -> Path:
    """The local folder of ``module``'s task written from its hub source (downloaded and written once)."""
    import pyarrow.parquet as pq

    from dlm.eval.tasks import path_flag  # a circle: dlm.eval.tasks imports this module

    repo, config, split = module.HUB
    try:
        folder = snapshot(repo, PARQUET_REVISION, [f"{config}/{split}/*.parquet"], kind="dataset")
    except DLMError as e:
        local = f"--data-dir DIR (with DIR/{module.SUBDIR}/...) or {path_flag(module.NAME)}"
        raise DLMError(f"task '{module.NAME}' has no local data, and from the hub: {e} (local files: {local})") from e
    files = sorted((folder / config / split).glob("*.parquet"))
    if not files:
        raise DLMError(
            f"dataset repository '{repo}' has no {config}/{split} parquet files on its {PARQUET_REVISION} branch; "
            f"pass a local file with {path_flag(module.NAME)}"
        )
    target = home() / "data" / repo.replace("/", "--") / folder.name / config / split / module.SUBDIR
    if target.is_dir():
        return target
    records = [r for f in files for r in pq.read_table(f).to_pylist()]
    try:
        written = module.hub_files(records)
    except (KeyError, ValueError, TypeError) as e:
        msg = f"dataset repository '{repo}' ({config}/{split}): a record lacks what {module.NAME} reads ({e})"
        raise DLMError(msg) from e
    with atomic_folder(target) as tmp:
        for name, text in written.items():
            (Path(tmp) / name).write_text(text, encoding="utf-8")
    return target
