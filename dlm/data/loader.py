"""Streaming blocks of tokens from LITPKDS shards: rank/worker-aware, seeded, resumable, weighted mixing.

:class:`PackedDataset` reads ``block_size``-token blocks from memory-mapped shards (docs/algorithms.md#shards):

- **Who reads what.** There are ``C = world_size * num_workers`` consumers; consumer ``c = rank * num_workers +
  worker`` (rank-major, as the reference). In epoch ``e`` the files are permuted with a seeded RNG
  (``seed, e``; identical on every rank) and consumer ``c`` takes positions ``r, r + C, r + 2C, ...`` with
  ``r = (c + e) % C``. Every file is read by exactly one consumer per epoch and nothing is dropped. When the file
  count does not divide by ``C`` some consumers get one file more in an epoch; the offset ``e`` rotates which ones,
  so over any ``C`` consecutive epochs every consumer reads exactly the same number of files (the reference
  silently drops the extra files instead). Fewer files than consumers is an error (a consumer with nothing to read
  would hang a distributed run): write smaller shards or use fewer workers.
- **Windows.** A consumer's files of an epoch are taken ``n_chunks`` at a time (the last window may be smaller:
  every file is read, also with fewer files than ``n_chunks``); each window's files are memory-mapped, cut into
  ``chunk_size // block_size`` blocks per file (blocks never cross files; a tail shorter than a block is skipped)
  and the block order within the window is shuffled with a seeded RNG (``seed, e, c, window``).
- **Validation.** Every file's header (magic, version, dtype, chunk size) and size is checked when the dataset is
  built, naming the file; ``chunk_size >= block_size`` is required. A file that ``manifest.json`` beside it lists
  is checked against the manifest's sha256 the first time a process opens it (``verify=True``), so a bit flipped
  on disk is an error naming the file, never silently different tokens.
- **Exact resume.** Everything above is a pure function of (seed, epoch, consumer), so the state is just the number
  of blocks each consumer has yielded: :meth:`PackedDataset.state_dict` / :meth:`load_state_dict`; after loading,
  iteration yields exactly what the uninterrupted iterator would have yielded next. The counts are tracked in the
  process that iterates: with ``DataLoader(num_workers=0)`` call ``state_dict()`` directly; with worker processes
  use :meth:`PackedDataset.state_dict_for_dataloader` (PyTorch's DataLoader takes batches from workers round-robin).
- **Distributed.** ``rank`` / ``world_size`` default to ``torch.distributed`` when initialized, else the
  ``RANK`` / ``WORLD_SIZE`` environment variables (torchrun, accelerate launch), else 0 / 1. Each rank reads its own
  files, so with accelerate prepare the DataLoader with ``DataLoaderConfiguration(dispatch_batches=False)``
  (accelerate's default for iterable datasets reads on rank 0 only and dispatches).

:class:`CombinedDataset` mixes several datasets with weights: the source of draw ``i`` of consumer ``c`` comes
from ``np.random.default_rng([seed, c, i // 4096])``, so it is deterministic and resumable from a draw count.
:func:`build_packed_dataset` is the trainer's entry point.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from dlm.data.shards import HDR_SIZE, MANIFEST_NAME, read_header, read_manifest, sha256_file
from dlm.errors import DLMError

_DRAW_CHUNK = 4096


def default_rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world_size): explicit values, else torch.distributed, else $RANK/$WORLD_SIZE, else (0, 1)."""
    if rank is None or world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            r, w = dist.get_rank(), dist.get_world_size()
        else:
            r, w = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        rank = r if rank is None else rank
        world_size = w if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise DLMError(f"invalid rank {rank} for world size {world_size}")
    return rank, world_size


class PackedDataset(IterableDataset):
    """Blocks of ``block_size`` tokens (int64 tensors) from LITPKDS shard files; see the module docstring."""

    def __init__(
        self,
        filenames: Sequence[str | os.PathLike],
        block_size: int,
        n_chunks: int = 8,
        seed: int = 12345,
        shuffle: bool = True,
        wrap: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        verify: bool = True,
    ):
        super().__init__()
        self.files = sorted(str(f) for f in filenames)
        if not self.files:
            raise DLMError("PackedDataset got no shard files; check the data folder and prefix")
        if block_size < 1 or n_chunks < 1:
            raise DLMError(f"block_size ({block_size}) and n_chunks ({n_chunks}) must be positive")
        self.block_size, self.n_chunks, self.seed = int(block_size), int(n_chunks), int(seed)
        self.shuffle, self.wrap = shuffle, wrap
        self.rank, self.world_size = rank, world_size
        self.headers = [read_header(f) for f in self.files]
        for h in self.headers:
            if h.chunk_size < self.block_size:
                raise DLMError(
                    f"shard '{h.path}' holds {h.chunk_size} tokens, fewer than block_size "
                    f"{self.block_size}; re-run dlm prepare with a larger --chunk-size or use a smaller "
                    f"block size"
                )
        self.n_blocks = np.array([h.chunk_size // self.block_size for h in self.headers], dtype=np.int64)
        self.verify = verify
        self._expected_sha = _manifest_hashes(self.files) if verify else {}
        self._verified: set[int] = set()
        self._start: dict[int, int] = {}
        self._consumed: dict[int, int] = {}
        self._num_consumers: int | None = None
        self._worker_shift = 0

    # ---------------------------------------------------------------------------------------- topology
    def consumer(self) -> tuple[int, int]:
        """(consumer id, number of consumers) of the calling process/worker."""
        rank, world = default_rank_world(self.rank, self.world_size)
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        # After a resume from a DataLoader batch count, worker 0 plays the consumer whose batch came next.
        wid = (wid + self._worker_shift) % nw
        return rank * nw + wid, world * nw

    def epoch_files(self, epoch: int, cid: int, n_consumers: int) -> np.ndarray:
        """Indices (into ``self.files``) that consumer ``cid`` reads in ``epoch``, in reading order."""
        n = len(self.files)
        perm = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        return perm[(cid + epoch) % n_consumers :: n_consumers]

    def _window_order(self, epoch: int, cid: int, w: int, window: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        counts = self.n_blocks[window]
        fidx = np.repeat(window, counts)
        bidx = np.concatenate([np.arange(c) for c in counts]) if len(counts) else np.zeros(0, np.int64)
        if self.shuffle:
            p = np.random.default_rng([self.seed, epoch, cid, w]).permutation(len(fidx))
            fidx, bidx = fidx[p], bidx[p]
        return fidx, bidx

    # ---------------------------------------------------------------------------------------- iteration
    def __iter__(self):
        cid, n_consumers = self.consumer()
        if len(self.files) < n_consumers:
            raise DLMError(
                f"{len(self.files)} shard file(s) for {n_consumers} consumers (world size x dataloader "
                f"workers): every consumer needs at least one file; use fewer workers or re-run dlm "
                f"prepare with a smaller --chunk-size"
            )
        if self._num_consumers is not None and self._num_consumers != n_consumers and self._start:
            raise DLMError(
                f"the loaded state was saved with {self._num_consumers} consumers (world size x workers) "
                f"but now there are {n_consumers}; resume with the same world size and num_workers"
            )
        self._num_consumers = n_consumers
        skip = self._start.get(cid, 0)
        self._consumed[cid] = skip
        return self._generate(cid, n_consumers, skip)

    def _generate(self, cid: int, n_consumers: int, skip: int):
        bs = self.block_size
        epoch = 0
        while True:
            files = self.epoch_files(epoch, cid, n_consumers)
            for w, start in enumerate(range(0, len(files), self.n_chunks)):
                window = files[start : start + self.n_chunks]
                total = int(self.n_blocks[window].sum())
                if skip >= total:
                    skip -= total
                    continue
                for f in window.tolist():
                    self._check_hash(f)
                fidx, bidx = self._window_order(epoch, cid, w, window)
                maps = {
                    int(f): np.memmap(
                        self.files[f],
                        dtype=self.headers[f].dtype,
                        mode="r",
                        offset=HDR_SIZE,
                        shape=(self.headers[f].chunk_size,),
                    )
                    for f in window
                }
                for f, b in zip(fidx[skip:].tolist(), bidx[skip:].tolist()):
                    block = maps[f][b * bs : (b + 1) * bs].astype(np.int64)
                    self._consumed[cid] += 1
                    yield torch.from_numpy(block)
                skip = 0
                del maps
            epoch += 1
            if not self.wrap:
                return

    def _check_hash(self, f: int) -> None:
        """The first time this process opens file ``f``: its sha256 against the manifest's (when it lists it)."""
        if f in self._verified or f not in self._expected_sha:
            return

        expected, manifest = self._expected_sha[f]
        if sha256_file(self.files[f]) != expected:
            raise DLMError(
                f"shard '{self.files[f]}' is corrupt: its sha256 differs from the one in '{manifest}' "
                f"(changed or damaged on disk since dlm prepare wrote it); re-run dlm prepare "
                f"--overwrite for its prefix, or restore the file"
            )
        self._verified.add(f)

    # ---------------------------------------------------------------------------------------- state
    def _fingerprint(self) -> str:
        h = hashlib.sha256()
        for f, hd in zip(self.files, self.headers):
            h.update(f"{os.path.basename(f)}:{hd.chunk_size}\n".encode())
        return h.hexdigest()[:16]

    def state_dict(self) -> dict:
        """Blocks yielded so far per consumer (exact for iteration in this process, e.g. num_workers=0)."""
        return {
            "kind": "packed",
            "seed": self.seed,
            "block_size": self.block_size,
            "n_chunks": self.n_chunks,
            "shuffle": self.shuffle,
            "files": self._fingerprint(),
            "num_consumers": self._num_consumers,
            "consumed": {str(k): int(v) for k, v in self._consumed.items()},
            "worker_shift": self._worker_shift,
        }

    def state_dict_for_dataloader(self, num_batches: int, batch_size: int, num_workers: int) -> dict:
        """The state after a ``DataLoader(batch_size, num_workers>0)`` on this rank delivered ``num_batches``.

        PyTorch's DataLoader takes batch ``k`` from worker ``k % num_workers`` (in order), so worker ``w`` has
        produced ``ceil((num_batches - w) / num_workers)`` batches (valid while no worker runs dry, e.g. wrap=True).
        The next batch is due from worker ``num_batches % num_workers``, but a new DataLoader starts at worker 0,
        so the state also records that shift and the resumed workers take over each other's consumers accordingly.
        """
        rank, world = default_rank_world(self.rank, self.world_size)
        consumed = {}
        for w in range(num_workers):
            consumed[str(rank * num_workers + w)] = max(0, -(-(num_batches - w) // num_workers)) * batch_size
        state = self.state_dict()
        state.update(num_consumers=world * num_workers, consumed=consumed, worker_shift=num_batches % num_workers)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where ``state`` was taken (same files, seed, block size and consumer layout)."""
        mine = self.state_dict()
        for key in ("seed", "block_size", "n_chunks", "shuffle", "files"):
            if state.get(key) != mine[key]:
                raise DLMError(
                    f"cannot resume the packed dataset: '{key}' differs (saved {state.get(key)!r}, now "
                    f"{mine[key]!r}); resume with the same data files and loader settings"
                )
        self._start = {int(k): int(v) for k, v in state.get("consumed", {}).items()}
        self._consumed = dict(self._start)
        self._num_consumers = state.get("num_consumers")
        self._worker_shift = int(state.get("worker_shift", 0))


class CombinedDataset(IterableDataset):
    """Weighted mixture of datasets: each next block comes from dataset ``i`` with probability ``weights[i]``.

    Deterministic for a seed and exactly resumable (state = draws made + each dataset's state). Iteration stops
    when any (finite) dataset is exhausted, like the reference.
    """

    def __init__(self, datasets: Sequence[PackedDataset], weights: Sequence[float] | None = None, seed: int = 12345):
        super().__init__()
        self.datasets = list(datasets)
        if not self.datasets:
            raise DLMError("CombinedDataset needs at least one dataset")
        w = np.asarray(weights if weights is not None else [1.0] * len(self.datasets), dtype=np.float64)
        if len(w) != len(self.datasets) or (w < 0).any() or w.sum() <= 0:
            raise DLMError(f"weights {list(w)} must be {len(self.datasets)} non-negative numbers with a positive sum")
        self.weights = w / w.sum()
        self.seed = int(seed)
        self._start: dict[int, int] = {}
        self._draws: dict[int, int] = {}

    def _choices(self, cid: int, chunk: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, cid, chunk])
        return rng.choice(len(self.datasets), size=_DRAW_CHUNK, p=self.weights)

    def __iter__(self):
        cid, _ = self.datasets[0].consumer()
        its = [iter(d) for d in self.datasets]
        draw = self._start.get(cid, 0)
        self._draws[cid] = draw
        return self._generate(cid, its, draw)

    def _generate(self, cid, its, draw):
        chunk, choices = -1, None
        while True:
            if draw // _DRAW_CHUNK != chunk:
                chunk = draw // _DRAW_CHUNK
                choices = self._choices(cid, chunk)
            try:
                item = next(its[choices[draw % _DRAW_CHUNK]])
            except StopIteration:
                return
            draw += 1
            self._draws[cid] = draw
            yield item

    def state_dict(self) -> dict:
        return {
            "kind": "combined",
            "seed": self.seed,
            "weights": self.weights.tolist(),
            "draws": {str(k): int(v) for k, v in self._draws.items()},
            "datasets": [d.state_dict() for d in self.datasets],
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "combined" or len(state.get("datasets", [])) != len(self.datasets):
            raise DLMError("cannot resume: the saved data state is not a mixture of the same number of prefixes")
        if state["seed"] != self.seed or not np.allclose(state["weights"], self.weights):
            raise DLMError(
                f"cannot resume: seed/weights differ (saved {state['seed']}, {state['weights']}; now "
                f"{self.seed}, {self.weights.tolist()})"
            )
        self._start = {int(k): int(v) for k, v in state["draws"].items()}
        self._draws = dict(self._start)
        for d, s in zip(self.datasets, state["datasets"]):
            d.load_state_dict(s)


def _manifest_hashes(files: list[str]) -> dict[int, tuple[str, str]]:
    """{file index: (sha256, manifest path)} for the files a ``manifest.json`` beside them lists (dlm prepare's;
    shards from elsewhere have none and are read unverified)."""

    by_folder: dict[str, dict[str, str]] = {}
    out = {}
    for i, f in enumerate(files):
        folder = os.path.dirname(os.path.abspath(f))
        if folder not in by_folder:
            table = {}
            if os.path.isfile(os.path.join(folder, MANIFEST_NAME)):
                for entry in read_manifest(folder)["prefixes"].values():
                    for sh in entry.get("shards", []) if isinstance(entry, dict) else []:
                        if isinstance(sh, dict) and isinstance(sh.get("sha256"), str):
                            table[str(sh.get("file"))] = sh["sha256"]
            by_folder[folder] = table
        digest = by_folder[folder].get(os.path.basename(f))
        if digest is not None:
            out[i] = (digest, os.path.join(folder, MANIFEST_NAME))
    return out


def find_shards(data_dir: str | os.PathLike, prefix: str) -> list[str]:
    """Shard files ``{prefix}*.bin`` in ``data_dir`` (the reference's glob), sorted; DLMError when none."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DLMError(f"packed data folder '{data_dir}' does not exist; run dlm prepare first")
    files = sorted(glob.glob(str(data_dir / f"{glob.escape(prefix)}*.bin")))
    if not files:
        have = sorted({p.name.rsplit("_", 1)[0] for p in data_dir.glob("*.bin")})[:10]
        raise DLMError(
            f"no shard matches prefix '{prefix}' in '{data_dir}' (prefixes there: "
            f"{', '.join(have) or 'none'}); check --packed-prefixes or run dlm prepare"
        )
    return files


def build_packed_dataset(
    data_dir: str | os.PathLike,
    prefixes: Sequence[str] | str,
    weights=None,
    *,
    block_size: int,
    seed: int = 12345,
    rank: int | None = None,
    world_size: int | None = None,
    n_chunks: int = 8,
    shuffle: bool = True,
    wrap: bool = True,
):
    """The trainer's data: one :class:`PackedDataset` per prefix, mixed by :class:`CombinedDataset` when several.

    ``block_size`` is free (e.g. seq_length + 1 for next-token targets); every shard must hold at least that many
    tokens. ``wrap=True`` (default) iterates forever over reshuffled epochs. Both return types have
    ``state_dict()`` / ``load_state_dict()``.
    """
    if isinstance(prefixes, str):
        prefixes = [p for p in prefixes.split(",") if p]
    if not prefixes:
        raise DLMError("no packed prefixes given")
    if weights is not None and len(weights) != len(prefixes):
        raise DLMError(f"{len(weights)} weights for {len(prefixes)} prefixes; give one weight per prefix")
    sets = [
        PackedDataset(
            find_shards(data_dir, p),
            block_size,
            n_chunks=n_chunks,
            seed=seed + i,
            shuffle=shuffle,
            wrap=wrap,
            rank=rank,
            world_size=world_size,
        )
        for i, p in enumerate(prefixes)
    ]
    if len(sets) == 1:
        return sets[0]
    return CombinedDataset(sets, weights, seed=seed)
