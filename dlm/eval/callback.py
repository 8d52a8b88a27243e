"""Scheduled task evaluation during training: a trainer callback (:class:`dlm.train.loop.Callback`) that runs
:func:`dlm.eval.run_eval` on ``eval.eval_tasks`` at every ``eval.eval_every`` steps (main process, the unwrapped
model, no gradients). ``dlm train`` adds it when ``--eval-tasks`` is given; the trainer itself does not import
the evaluation package."""

from __future__ import annotations

import torch

from dlm.eval import EvalSettings, run_eval


class TaskEvaluation:
    def setup(self, trainer) -> None:
        pass  # where evaluation cannot run, importing this module (before the first step) already failed

    def on_evaluate(self, trainer, step: int) -> dict:
        cfg, dlm = trainer.cfg, trainer.dlm
        was = dlm.training
        dlm.eval()
        try:
            with torch.no_grad():
                settings = EvalSettings(
                    data_dir=cfg.eval.eval_data_dir, limit=cfg.eval.eval_limit, batch_size=cfg.eval.eval_batch_size
                )
                result = run_eval(dlm, list(cfg.eval.eval_tasks), settings)
        finally:
            dlm.train(was)
        return dict(result) if isinstance(result, dict) else {"tasks": result}
