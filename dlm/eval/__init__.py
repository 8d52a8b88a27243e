"""Evaluation: multiple-choice and generation benchmarks, the eval history, the lm-evaluation-harness adapter.

- :func:`run_eval` ``(model, tasks, *, tokenizer=None, data_dir=None, paths=None, limit=None, ...) -> dict``:
  the entry point of ``dlm eval`` and of the trainer's scheduled evaluation.
- :func:`append_history` ``(path, step, checkpoint, metrics)``: one line of ``eval_history.jsonl``.
- ``dlm.eval.lm_eval``: the ``dlm`` model for lm-evaluation-harness (import it to register).
"""

from dlm.eval.history import append_history, flatten_metrics, read_history
from dlm.eval.runner import run_eval
from dlm.eval.tasks import DEFAULT_TASKS, TASKS

__all__ = ["run_eval", "append_history", "flatten_metrics", "read_history", "TASKS", "DEFAULT_TASKS"]
