"""Training a small drafter for a larger target (vLLM's parallel drafting, docs/vllm.md): the target cut to its first
layers (:func:`dlm.model.drafter.truncated_drafter`) trained as an I-DLM on the target's own answers. It lives under
train/ because it runs the training loop; model/ keeps the cutting and the export (model imports nothing from
train)."""

from __future__ import annotations

from pathlib import Path

from dlm.config import load_config
from dlm.errors import DLMError
from dlm.model.drafter import truncated_drafter
from dlm.train.loop import train

__all__ = ["train_small_drafter"]


def train_small_drafter(
    target,
    data,
    out,
    layers: int = 4,
    block_size: int = 2,
    minutes: float = 10.0,
    freeze_embeddings: bool = True,
    overrides: dict | None = None,
):
    """Cut ``target`` to ``layers`` layers and train it as an I-DLM on ``data`` (chat JSONL of the target's own
    greedy answers) for ``minutes``; return the trained folder (``out``). The layers and norms train (no
    adapters; the embedding and head too unless ``freeze_embeddings``, the default, which keeps the target's
    token vectors and makes each step cheaper): the clean path learns the target's next token (hard labels,
    ``ce_alpha`` 1), the masks the later ones. ``overrides``: the training config's fields by section, over this
    recipe's (learning rate 1e-3 with a WSD schedule, batch 4, sequences of 192 tokens, seed 0), e.g.
    ``{"optim": {"learning_rate": 3e-4}, "train": {"batch_size": 8}}``."""
    dlm = truncated_drafter(target, layers, block_size)
    if freeze_embeddings:
        hf = dlm.base_model_hf
        for module in (hf.get_input_embeddings(), hf.get_output_embeddings()):
            if module is not None:
                for p in module.parameters():
                    p.requires_grad_(False)
    recipe = {
        "model": {"objective": "idlm", "block_size": block_size},
        "data": {"data": str(data), "seq_length": 192, "eval_fraction": 0.02, "seed": 0},
        "idlm": {"idlm_loss_type": "ar", "ce_alpha": 1.0, "loss_auto_balance": False},
        "optim": {
            "learning_rate": 1e-3,
            "schedule": "wsd",
            "warmup_steps": 10,
            "decay_ratio": 0.25,
            "weight_decay": 0.0,
        },
        "train": {
            "batch_size": 4,
            "max_train_steps": 1_000_000,
            "max_minutes": minutes,
            "output_dir": str(out),
            "save_every": 100,
            "keep_last": 1,
            "seed": 0,
            "overwrite": True,
        },
        "eval": {"eval_every": 0},
    }
    for section, values in (overrides or {}).items():
        if not isinstance(values, dict):
            raise DLMError(f"train_small_drafter overrides: '{section}' must map field names to values, got {values!r}")
        recipe.setdefault(section, {}).update(values)
    given = overrides or {}
    if "seed" in given.get("train", {}) and "seed" not in given.get("data", {}):  # one seed: the run's and the split's
        recipe["data"]["seed"] = recipe["train"]["seed"]
    train(load_config(None, recipe), dlm=dlm)
    return Path(out)
