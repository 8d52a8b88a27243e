"""Multiple-choice evaluation: score every (context, choice) of a task and pick the best choice.

Causal models: the choice with the highest log-likelihood (``acc``) and the highest log-likelihood per character
of the choice (``acc_norm``, as lm-evaluation-harness normalizes by the choice's length). Bidirectional DLMs: the
choice with the lowest denoising score (``acc``); see :mod:`dlm.eval.scoring`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from dlm.eval.scoring import (
    DEFAULT_BATCH_TOKENS,
    EvalModel,
    denoising_scores,
    encode_pair,
    loglikelihoods,
    stderr_of_mean,
)
from dlm.eval.tasks.base import MCExample


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: values[i])


def score_examples(
    em: EvalModel,
    examples: Sequence[MCExample],
    task: str = "task",
    steps: int = 32,
    seed: int = 0,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    progress=None,
) -> list[list[float]]:
    """Per example, one score per choice, oriented so that higher = preferred.

    Causal: the log-likelihood. Diffusion: minus the denoising score (seeded by (seed, task, example index)).
    """
    pairs, keys, owner = [], [], []
    for i, ex in enumerate(examples):
        for c in ex.choices:
            pairs.append(encode_pair(em, ex.context, c))
            keys.append(f"{task}:{i}")
            owner.append(i)
    if em.kind == "causal":
        flat = [ll for ll, _ in loglikelihoods(em, pairs, batch_tokens, progress=progress)]
    else:
        flat = [
            -s
            for s in denoising_scores(
                em, pairs, keys, steps=steps, seed=seed, batch_tokens=batch_tokens, progress=progress
            )
        ]
    out: list[list[float]] = [[] for _ in examples]
    for i, v in zip(owner, flat):
        out[i].append(v)
    return out


def evaluate_multiple_choice(
    em: EvalModel,
    examples: Sequence[MCExample],
    task: str = "task",
    steps: int = 32,
    seed: int = 0,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    progress=None,
    keep_predictions: bool = False,
) -> dict:
    """Accuracy of ``em`` on ``examples``: ``{"acc", "acc_stderr", ["acc_norm", "acc_norm_stderr"], "n",
    "seconds", "scoring", ["predictions"]}``."""
    t0 = time.perf_counter()
    scores = score_examples(em, examples, task, steps, seed, batch_tokens, progress)
    hits = [float(_argmax(s) == ex.label) for s, ex in zip(scores, examples)]
    result = {"acc": sum(hits) / len(hits), "acc_stderr": stderr_of_mean(hits), "n": len(hits), "scoring": em.kind}
    if em.kind == "causal":
        norm = [
            float(_argmax([v / max(1, len(c)) for v, c in zip(s, ex.choices)]) == ex.label)
            for s, ex in zip(scores, examples)
        ]
        result["acc_norm"] = sum(norm) / len(norm)
        result["acc_norm_stderr"] = stderr_of_mean(norm)
    else:
        result["diffusion_steps"] = steps
        result["seed"] = seed
    result["seconds"] = time.perf_counter() - t0
    if keep_predictions:
        result["predictions"] = [
            {"id": ex.id, "label": ex.label, "scores": s, "pred": _argmax(s)} for s, ex in zip(scores, examples)
        ]
    return result
