"""The evaluation history: one JSON line per scheduled evaluation, tables and curves over checkpoints.

Line format of ``eval_history.jsonl`` (what the trainer appends through :func:`append_history`)::

    {"step": 500, "checkpoint": "step_00000500", "time": "2025-01-01T12:00:00+00:00",
     "metrics": {"piqa/acc": 0.61, "piqa/acc_stderr": 0.03, "heldout/loss": 2.3}}

``step`` is the optimizer step, ``checkpoint`` a name (usually the checkpoint folder's), ``time`` ISO-8601 UTC,
``metrics`` a flat ``{"task/metric": number}`` map (see :func:`flatten_metrics`).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

from dlm.errors import DLMError, require

_SKIP_IN_FLAT = {"n", "seconds", "predictions", "scoring", "decode", "diffusion_steps", "seed"}


def flatten_metrics(results: dict) -> dict[str, float]:
    """``{"piqa": {"acc": .6, "acc_stderr": .03, "n": 200, ...}}`` -> ``{"piqa/acc": .6, "piqa/acc_stderr": .03}``.

    Bookkeeping fields (n, seconds, predictions, settings) are left out; already flat keys pass through."""
    flat: dict[str, float] = {}
    for task, value in results.items():
        if isinstance(value, dict):
            for k, v in value.items():
                if k not in _SKIP_IN_FLAT and isinstance(v, (int, float)) and not isinstance(v, bool):
                    flat[f"{task}/{k}"] = float(v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[task] = float(value)
    return flat


def append_history(path: str | os.PathLike, step: int, checkpoint: str, metrics: dict) -> dict:
    """Append one line to ``path`` (created with its folder if missing) and return the record.

    ``metrics`` may be flat (``{"piqa/acc": 0.6}``) or :func:`dlm.eval.run_eval`'s nested result. The line is
    written with one ``write`` call on a file opened for appending, so a crash never leaves half a line before
    the next record.
    """
    record = {
        "step": int(step),
        "checkpoint": str(checkpoint),
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "metrics": flatten_metrics(metrics),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record, sort_keys=False) + "\n")
    return record


def read_history(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[dict]:
    """All records of one or more history files, in file order (a run's records first, then the next file's)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    records = []
    for p in paths:
        p = Path(p)
        if not p.is_file():
            raise DLMError(f"--history-paths: '{p}' does not exist; give the eval_history.jsonl of a training run")
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise DLMError(
                    f"'{p}' line {n} is not JSON; each line must be one record "
                    f'{{"step", "checkpoint", "time", "metrics"}}'
                ) from None
            if not isinstance(rec, dict) or not isinstance(rec.get("metrics"), dict):
                raise DLMError(
                    f"'{p}' line {n} has no 'metrics' object; expected "
                    f'{{"step": int, "checkpoint": str, "time": iso, "metrics": {{...}}}}'
                )
            rec.setdefault("checkpoint", f"step_{rec.get('step', n)}")
            rec["_source"] = str(p)
            records.append(rec)
    if not records:
        raise DLMError(f"no records in {', '.join(str(p) for p in paths)}")
    return records


def _column_names(records: list[dict]) -> list[str]:
    sources = {r["_source"] for r in records}
    names = []
    for r in records:
        name = str(r["checkpoint"])
        if len(sources) > 1:
            name = f"{Path(r['_source']).parent.name or Path(r['_source']).stem}:{name}"
        names.append(name)
    return names


def history_table(records: list[dict], stderr: bool = False) -> tuple[list[str], list[str], list[list[float | None]]]:
    """(metric names = rows, checkpoint names = columns, values[row][col] or None)."""
    metrics: list[str] = []
    for r in records:
        for k in r["metrics"]:
            if k not in metrics and (stderr or not k.endswith("_stderr")):
                metrics.append(k)
    cols = _column_names(records)
    values = [[r["metrics"].get(m) for r in records] for m in metrics]
    return metrics, cols, values


def format_history_table(records: list[dict]) -> str:
    """The checkpoint-by-metric table as text: rows metrics, columns checkpoints."""
    metrics, cols, values = history_table(records)
    width0 = max([len("metric")] + [len(m) for m in metrics])
    widths = [max(8, len(c)) for c in cols]
    lines = ["  ".join(["metric".ljust(width0)] + [c.rjust(w) for c, w in zip(cols, widths)])]
    lines.append("  ".join(["-" * width0] + ["-" * w for w in widths]))
    for m, row in zip(metrics, values):
        cells = ["-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4f}" for v in row]
        lines.append("  ".join([m.ljust(width0)] + [c.rjust(w) for c, w in zip(cells, widths)]))
    return "\n".join(lines)


def plot_history(records: list[dict], path: str | os.PathLike, metrics: Sequence[str] | None = None) -> Path:
    """One panel per metric, value against training step, one line per history file; written atomically."""

    matplotlib = require("matplotlib", "plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, _, _ = history_table(records)
    names = list(metrics) if metrics else names
    if not names:
        raise DLMError("the history holds no metrics to plot")
    n = len(names)
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.0 * nrows), squeeze=False)
    sources = list(dict.fromkeys(r["_source"] for r in records))
    for ax, name in zip(axes.flat, names):
        for src in sources:
            pts = [
                (r.get("step", i), r["metrics"][name])
                for i, r in enumerate(records)
                if r["_source"] == src and name in r["metrics"]
            ]
            if pts:
                xs, ys = zip(*pts)
                label = Path(src).parent.name or Path(src).name
                ax.plot(xs, ys, marker="o", label=label)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(sources) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path
