"""PackedDataset / CombinedDataset: coverage over ranks and workers, validation, determinism, exact resume."""

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from dlm.data.loader import CombinedDataset, PackedDataset, build_packed_dataset, find_shards
from dlm.data.shards import write_shard
from dlm.errors import DLMError

CHUNK, BLOCK = 64, 16  # 4 blocks per file


def make_files(folder, n, prefix="d", base=0):
    """n shards whose tokens encode (file, position): token = (base + file) * 1000 + position."""
    folder.mkdir(exist_ok=True)
    paths = []
    for i in range(n):
        p = folder / f"{prefix}_{i:010d}.bin"
        write_shard(p, (np.arange(CHUNK) + (base + i) * 1000).astype(np.int32))
        paths.append(p)
    return paths


def block_id(b):
    return int(b[0]) // 1000, (int(b[0]) % 1000) // BLOCK


def all_blocks(n, base=0):
    return Counter((base + f, k) for f in range(n) for k in range(CHUNK // BLOCK))


@pytest.mark.parametrize("n_files,world,n_chunks", [(7, 2, 3), (5, 3, 8), (3, 1, 8), (12, 4, 2)])
def test_every_block_read_exactly_once_over_ranks(tmp_path, n_files, world, n_chunks):
    files = make_files(tmp_path, n_files)
    got = Counter()
    per_rank = []
    for r in range(world):
        ds = PackedDataset(files, BLOCK, n_chunks=n_chunks, seed=3, rank=r, world_size=world)
        ids = [block_id(b) for b in ds]
        assert all(len(b) == BLOCK for b in ds)
        per_rank.append({f for f, _ in ids})
        got.update(ids)
    assert got == all_blocks(n_files)  # nothing dropped, nothing twice (the reference drops n % 8 / uneven files)
    assert sum(map(len, per_rank)) == n_files  # each file belongs to exactly one rank
    assert max(map(len, per_rank)) - min(map(len, per_rank)) <= 1


def test_ranks_times_dataloader_workers(tmp_path):
    files = make_files(tmp_path, 7)
    got = Counter()
    for r in range(2):
        ds = PackedDataset(files, BLOCK, n_chunks=2, seed=1, rank=r, world_size=2)
        for batch in DataLoader(ds, batch_size=2, num_workers=2):
            got.update(block_id(b) for b in batch)
    assert got == all_blocks(7)


def test_uneven_split_rotates_so_it_is_fair(tmp_path):
    ds = PackedDataset(make_files(tmp_path, 7), BLOCK, seed=5)
    consumers = 3
    for start in (0, 4):
        totals = Counter()
        for epoch in range(start, start + consumers):
            parts = [ds.epoch_files(epoch, c, consumers) for c in range(consumers)]
            assert sorted(np.concatenate(parts).tolist()) == list(range(7))  # a partition in every epoch
            totals.update({c: len(p) for c, p in enumerate(parts)})
        assert set(totals.values()) == {7}  # over any C consecutive epochs every consumer reads 7 files


def test_fewer_files_than_consumers_is_a_clear_error(tmp_path):
    ds = PackedDataset(make_files(tmp_path, 2), BLOCK, rank=0, world_size=3)
    with pytest.raises(DLMError, match="2 shard file.*3 consumers"):
        next(iter(ds))


def test_validation_names_the_file(tmp_path):
    files = make_files(tmp_path, 4)
    data = files[2].read_bytes()
    files[2].write_bytes(data[:-10])
    with pytest.raises(DLMError, match=f"{files[2]}.*truncated"):
        PackedDataset(files, BLOCK)
    files[2].write_bytes(b"GARBAGE" + data[7:])
    with pytest.raises(DLMError, match=f"{files[2]}.*not a LITPKDS"):
        PackedDataset(files, BLOCK)
    files[2].write_bytes(data)
    with pytest.raises(DLMError, match="fewer than block_size 65"):
        PackedDataset(files, CHUNK + 1)
    with pytest.raises(DLMError, match="no shard matches prefix 'nope'.*prefixes there: d"):
        build_packed_dataset(tmp_path, ["nope"], block_size=BLOCK)


def test_seeded_shuffle_is_deterministic(tmp_path):
    files = make_files(tmp_path, 6)
    order = lambda seed, shuffle=True: [
        block_id(b)
        for b in PackedDataset(
            files,
            BLOCK,
            n_chunks=3,
            seed=seed,  # noqa
            shuffle=shuffle,
        )
    ]
    assert order(7) == order(7)
    assert order(7) != order(8)
    assert sorted(order(7)) == sorted(order(8))
    assert order(0, shuffle=False) == sorted(order(0, shuffle=False))
    # blocks stay within their window of n_chunks files
    first_window = {f for f, _ in order(7)[:12]}
    assert len(first_window) == 3


def test_block_size_is_free_and_blocks_never_cross_files(tmp_path):
    files = make_files(tmp_path, 3)
    ds = PackedDataset(files, 17, shuffle=False)  # seq_length + 1 style; 64 // 17 = 3 blocks, a 13-token tail
    blocks = list(ds)
    assert len(blocks) == 9 and all(b.dtype == torch.int64 and len(b) == 17 for b in blocks)
    assert all(int(b[-1]) // 1000 == int(b[0]) // 1000 for b in blocks)


def _take(it, n):
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("cut", [0, 5, 23, 61])
def test_exact_resume_across_windows_and_epochs(tmp_path, cut):
    files = make_files(tmp_path, 5)
    make = lambda: PackedDataset(files, BLOCK, n_chunks=2, seed=11, wrap=True, rank=1, world_size=2)  # noqa
    ref = _take(iter(make()), 90)
    ds = make()
    it = iter(ds)
    _take(it, cut)
    state = ds.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    rest = _take(iter(resumed), 90 - cut)
    assert all(torch.equal(a, b) for a, b in zip(ref[cut:], rest))


def test_combined_mixing_weights_determinism_and_resume(tmp_path):
    a = make_files(tmp_path / "a", 4, "a", base=0)
    b = make_files(tmp_path / "b", 4, "b", base=100)

    def make(seed=9):
        return CombinedDataset(
            [PackedDataset(a, BLOCK, seed=1, wrap=True), PackedDataset(b, BLOCK, seed=2, wrap=True)],
            weights=[0.8, 0.2],
            seed=seed,
        )

    ref = _take(iter(make()), 3000)
    frac_b = np.mean([int(x[0]) >= 100_000 for x in ref])
    assert abs(frac_b - 0.2) < 0.03
    assert all(torch.equal(x, y) for x, y in zip(ref, _take(iter(make()), 3000)))
    assert not all(torch.equal(x, y) for x, y in zip(ref[:50], _take(iter(make(seed=10)), 50)))
    ds = make()
    it = iter(ds)
    _take(it, 1234)
    state = ds.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(ref[1234:], _take(iter(resumed), 3000 - 1234)))
    with pytest.raises(DLMError, match="seed/weights differ"):
        make(seed=1).load_state_dict(state)


def test_dataloader_workers_resume_from_batch_count(tmp_path):
    files = make_files(tmp_path, 6)
    make = lambda: PackedDataset(files, BLOCK, n_chunks=2, seed=4, wrap=True, rank=0, world_size=1)  # noqa
    ref = [b for _, b in zip(range(20), DataLoader(make(), batch_size=3, num_workers=2))]
    ds = make()
    state = ds.state_dict_for_dataloader(num_batches=7, batch_size=3, num_workers=2)
    resumed = make()
    resumed.load_state_dict(state)
    rest = [b for _, b in zip(range(13), DataLoader(resumed, batch_size=3, num_workers=2))]
    assert all(torch.equal(x, y) for x, y in zip(ref[7:], rest))


def test_rank_world_from_environment(tmp_path, monkeypatch):
    files = make_files(tmp_path, 4)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    env_ids = [block_id(b) for b in build_packed_dataset(tmp_path, "d", block_size=BLOCK, wrap=False)]
    explicit = [
        block_id(b) for b in build_packed_dataset(tmp_path, ["d"], block_size=BLOCK, wrap=False, rank=1, world_size=2)
    ]
    assert env_ids == explicit and len({f for f, _ in env_ids}) == 2
    assert find_shards(tmp_path, "d") == [str(p) for p in files]
