"""Evaluation: multiple-choice and generation benchmarks, the eval history, the lm-evaluation-harness adapter.

- :func:`run_eval` ``(model, tasks, settings=EvalSettings(...), *, tokenizer=None, ...) -> dict``: the entry point
  of ``dlm eval``, of the trainer's scheduled evaluation and of the lm-evaluation-harness model; :class:`EvalSettings`
  holds how it evaluates (examples, scoring, the generation decoder), one default each.
- :func:`append_history` ``(path, step, checkpoint, metrics)``: one line of ``eval_history.jsonl``.
- ``dlm.eval.lm_eval``: the ``dlm`` model for lm-evaluation-harness (import it to register).
"""

from dlm.eval.history import append_history, flatten_metrics, read_history
from dlm.eval.runner import EvalSettings, run_eval
from dlm.eval.tasks import DEFAULT_TASKS, TASKS

__all__ = ["run_eval", "EvalSettings", "append_history", "flatten_metrics", "read_history", "TASKS", "DEFAULT_TASKS"]
