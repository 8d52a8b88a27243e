"""Training: ``train(cfg)`` runs one loop for every objective on accelerate (see :mod:`dlm.train.loop`).

from dlm.config import load_config
from dlm.train import train
result = train(load_config("idlm_b2_cpu", {"data": "chat.jsonl", "max_minutes": 10}))
"""

from __future__ import annotations

from dlm.train.loop import train as _train


def train(cfg, objective=None, dlm=None):
    """Lazy alias of :func:`dlm.train.loop.train` (keeps ``import dlm.train`` light)."""

    return _train(cfg, objective=objective, dlm=dlm)


__all__ = ["train"]
