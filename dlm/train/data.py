"""Batching glue between the data sources and the training loop.

Both sources give an endless, rank-aware, exactly resumable stream of batches in the objectives' format
(``input_ids`` [B, L], ``labels`` [B, L] aligned with ``input_ids``, optional ``attention_mask`` [B, L]):

- :class:`PackedBatches`: ``batch_size`` blocks of ``seq_length`` tokens from LITPKDS shards
  (:func:`dlm.data.loader.build_packed_dataset`, which splits files over ranks itself); labels = input_ids (every
  token is trained).
- :class:`SFTBatches`: tokenized chat/instruction examples (:mod:`dlm.data.sft`); each epoch is a seeded
  permutation shared by all ranks, rank ``r`` takes positions ``r, r + W, ...``, batches are padded by
  :class:`~dlm.data.sft.SFTCollator`; the last incomplete batch of an epoch is dropped so every rank makes the
  same number of steps.

We iterate in the training process (no DataLoader workers, no ``accelerator.prepare`` of the loader): each rank
reads only its own data, which sidesteps accelerate's ``dispatch_batches`` (rank 0 reading everything), and the
state is exact. ``state_dict()`` is the position after the last batch handed out.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from dlm.errors import DLMError


class PackedBatches:
    """Endless batches of packed blocks; every token trained."""

    def __init__(self, dataset, batch_size: int):
        self.dataset = dataset
        self.batch_size = batch_size
        self._it = None

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, Any]:
        if self._it is None:
            self._it = iter(self.dataset)
        try:
            blocks = [next(self._it) for _ in range(self.batch_size)]
        except StopIteration:  # pragma: no cover - build_packed_dataset wraps around forever
            raise DLMError("the packed dataset ran out of blocks") from None
        ids = torch.stack(blocks)
        return {"input_ids": ids, "labels": ids.clone()}

    def state_dict(self) -> dict:
        return {"kind": "packed_batches", "dataset": self.dataset.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "packed_batches":
            raise DLMError("cannot resume: the checkpoint was trained on chat data (--data), not packed shards")
        self.dataset.load_state_dict(state["dataset"])
        self._it = None


class SFTBatches:
    """Endless batches of tokenized examples, an independent seeded shuffle per epoch."""

    def __init__(
        self, examples: list[dict], batch_size: int, collator, rank: int = 0, world_size: int = 1, seed: int = 0
    ):
        self.examples = examples
        self.batch_size = batch_size
        self.collator = collator
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.per_rank = len(examples) // world_size
        self.batches_per_epoch = self.per_rank // batch_size
        if self.batches_per_epoch < 1:
            raise DLMError(
                f"{len(examples)} training examples cannot fill one batch of {batch_size} on each of "
                f"{world_size} process(es); lower --batch-size or add data"
            )
        self.epoch = 0
        self.batch = 0  # next batch within the epoch
        self._order: list[int] | None = None

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            order = list(range(len(self.examples)))
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
            self._order = order[self.rank :: self.world_size][: self.per_rank]
        return self._order

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, Any]:
        if self.batch >= self.batches_per_epoch:
            self.epoch, self.batch, self._order = self.epoch + 1, 0, None
        order = self._epoch_order()
        idx = order[self.batch * self.batch_size : (self.batch + 1) * self.batch_size]
        self.batch += 1
        return self.collator([self.examples[i] for i in idx])

    def state_dict(self) -> dict:
        return {
            "kind": "sft_batches",
            "epoch": self.epoch,
            "batch": self.batch,
            "n": len(self.examples),
            "rank": self.rank,
            "world_size": self.world_size,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "sft_batches":
            raise DLMError("cannot resume: the checkpoint was trained on packed shards, not chat data (--data)")
        for key, mine in (("n", len(self.examples)), ("world_size", self.world_size), ("seed", self.seed)):
            if state[key] != mine:
                raise DLMError(
                    f"cannot resume the chat data position: '{key}' differs (saved {state[key]}, now "
                    f"{mine}); resume with the same --data file, seed and number of processes"
                )
        self.epoch, self.batch, self._order = int(state["epoch"]), int(state["batch"]), None


def split_heldout(records: list, fraction: float, seed: int) -> tuple[list, list]:
    """(train, heldout): a seeded ``fraction`` of the records (at least one when fraction > 0 and >= 2 records)."""
    if fraction <= 0 or len(records) < 2:
        return records, []
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n = max(1, int(round(fraction * len(records))))
    held = set(order[:n])
    return [r for i, r in enumerate(records) if i not in held], [r for i, r in enumerate(records) if i in held]


def heldout_batches(
    examples: list[dict], batch_size: int, collator, max_batches: int, rank: int, world_size: int
) -> list[dict]:
    """This rank's share of the first ``max_batches * world_size`` held-out batches (fixed, in file order)."""
    batches = [examples[i : i + batch_size] for i in range(0, len(examples), batch_size)][: max_batches * world_size]
    return [collator(b) for b in batches[rank::world_size]]
