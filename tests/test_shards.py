"""LITPKDS shards: byte layout against an independent writer/reader written from docs/algorithms.md#shards."""

import hashlib
import json
import os

import numpy as np
import pytest

from dlm.data.loader import PackedDataset
from dlm.data.shards import ShardWriter, choose_dtype, read_header, read_manifest, read_shard, update_manifest
from dlm.errors import DLMError

# ------------------------------------------------------------------ independent implementation of docs/algorithms.md#shards
# Written from the table in docs/algorithms.md#shards only (no import from dlm): magic, uint64 version, uint8 dtype code,
# uint64 chunk_size, then the tokens, all little-endian.
SPEC_CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float32": 6, "float64": 7, "uint16": 8}
SPEC_FORMATS = {"uint16": "<u2", "int32": "<i4"}


def spec_write(path, tokens, dtype_name):
    payload = np.asarray(tokens).astype(SPEC_FORMATS[dtype_name]).tobytes()
    n = len(tokens)
    head = b"LITPKDS" + (1).to_bytes(8, "little") + bytes([SPEC_CODES[dtype_name]]) + n.to_bytes(8, "little")
    with open(path, "wb") as f:
        f.write(head + payload)


def spec_read(path):
    raw = open(path, "rb").read()
    assert raw[:7] == b"LITPKDS"
    assert int.from_bytes(raw[7:15], "little") == 1
    code = raw[15]
    name = {v: k for k, v in SPEC_CODES.items()}[code]
    n = int.from_bytes(raw[16:24], "little")
    arr = np.frombuffer(raw[24:], dtype=SPEC_FORMATS[name])
    assert len(arr) == n
    return arr


def spec_build(stream, chunk_size, sep, prefix, folder, dtype_name, write_remainder=False):
    """The reference builder (docs/algorithms.md#shards): buffer pre-filled with sep; each full buffer -> {prefix}_{counter:010d}.bin."""
    names, counter = [], 0
    for start in range(0, len(stream), chunk_size):
        part = list(stream[start : start + chunk_size])
        if len(part) < chunk_size:
            if not write_remainder:
                break
            part = part + [sep] * (chunk_size - len(part))
        name = f"{prefix}_{counter:010d}.bin"
        spec_write(os.path.join(folder, name), part, dtype_name)
        names.append(name)
        counter += 1
    return names


def _docs(seed=0, n=60, vocab=50000):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=int(rng.integers(1, 300))).tolist() for _ in range(n)]


@pytest.mark.parametrize("dtype_name,remainder", [("uint16", False), ("uint16", True), ("int32", True)])
def test_writer_is_byte_identical_to_spec_builder(tmp_path, dtype_name, remainder):
    docs, eos, sep, chunk = _docs(), 0, 7, 1000
    stream = [t for d in docs for t in d + [eos]]
    (tmp_path / "ours").mkdir()
    (tmp_path / "spec").mkdir()
    w = ShardWriter(tmp_path / "ours", "train", chunk, sep, np.dtype(dtype_name))
    for d in docs:
        w.add(np.array(d + [eos]))
    dropped = w.finish(write_remainder=remainder)
    names = spec_build(stream, chunk, sep, "train", tmp_path / "spec", dtype_name, write_remainder=remainder)
    assert [s["file"] for s in w.shards] == names and len(names) >= 5
    for name in names:
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "spec" / name).read_bytes()
    assert dropped == (0 if remainder else len(stream) % chunk)
    real = [s["tokens"] for s in w.shards]
    assert sum(real) == (len(stream) if remainder else len(stream) - len(stream) % chunk)
    for s in w.shards:
        assert s["sha256"] == hashlib.sha256((tmp_path / "ours" / s["file"]).read_bytes()).hexdigest()
    assert not [p for p in os.listdir(tmp_path / "ours") if p.endswith(".tmp")]


def test_exact_boundary_writes_last_full_chunk_and_no_empty_remainder(tmp_path):
    w = ShardWriter(tmp_path, "x", 10, 0, np.uint16)
    w.add(np.arange(1, 31))
    assert w.finish(write_remainder=True) == 0
    assert [s["file"] for s in w.shards] == ["x_0000000000.bin", "x_0000000001.bin", "x_0000000002.bin"]
    assert spec_read(tmp_path / "x_0000000002.bin").tolist() == list(range(21, 31))


def test_resumed_writer_continues_identically(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    stream = np.arange(1, 95, dtype=np.uint16)
    w = ShardWriter(a, "p", 20, 3, np.uint16)
    w.add(stream)
    w.finish(True)
    w1 = ShardWriter(b, "p", 20, 3, np.uint16)
    w1.add(stream[:47])
    w2 = ShardWriter(b, "p", 20, 3, np.uint16, counter=w1.counter, pending=w1.pending())
    w2.add(stream[47:])
    w2.finish(True)
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    for n in os.listdir(a):
        assert (a / n).read_bytes() == (b / n).read_bytes()


def test_spec_files_load_in_our_reader_and_loader(tmp_path):
    rng = np.random.default_rng(1)
    tokens = [rng.integers(0, 60000, 64).tolist() for _ in range(3)]
    for i, t in enumerate(tokens):
        spec_write(tmp_path / f"ext_{i:010d}.bin", t, "uint16")
    h = read_header(tmp_path / "ext_0000000000.bin")
    assert h.dtype == np.uint16 and h.chunk_size == 64
    assert read_shard(tmp_path / "ext_0000000001.bin").tolist() == tokens[1]
    ds = PackedDataset(sorted(tmp_path.glob("ext_*.bin")), block_size=16, shuffle=False, rank=0, world_size=1)
    got = [b.tolist() for b in ds]
    want = [t[i : i + 16] for t in tokens for i in range(0, 64, 16)]
    assert sorted(got) == sorted(want) and len(got) == 12


def test_our_files_read_by_spec_reader(tmp_path):
    w = ShardWriter(tmp_path, "q", 50, 9, np.int32)
    w.add(np.arange(70_000, 70_120))
    w.finish(True)
    assert spec_read(tmp_path / "q_0000000002.bin").tolist() == list(range(70_100, 70_120)) + [9] * 30


def _corrupt_variants(tmp_path):
    spec_write(tmp_path / "good.bin", list(range(32)), "uint16")
    good = (tmp_path / "good.bin").read_bytes()
    yield "magic", b"NOTPKDS" + good[7:], "not a LITPKDS shard"
    yield "version", good[:7] + (2).to_bytes(8, "little") + good[15:], "version 2"
    yield "dtype", good[:15] + bytes([42]) + good[16:], "unknown dtype code 42"
    yield "truncated", good[:-6], "truncated"
    yield "header", good[:10], "truncated"
    yield "long", good + b"\0\0", "longer than its header"


def test_header_validation_names_the_file(tmp_path):
    for name, data, msg in list(_corrupt_variants(tmp_path)):
        p = tmp_path / f"bad_{name}.bin"
        p.write_bytes(data)
        with pytest.raises(DLMError) as e:
            read_header(p)
        assert str(p) in str(e.value) and msg in str(e.value), (name, str(e.value))


def test_choose_dtype():
    assert choose_dtype(49152) == np.uint16
    assert choose_dtype(65499) == np.uint16
    assert choose_dtype(65500) == np.int32
    assert choose_dtype(128256) == np.int32
    assert choose_dtype(320, "int32") == np.int32
    with pytest.raises(DLMError, match="int32"):
        choose_dtype(128256, "uint16")


def test_manifest_keeps_prefixes_apart(tmp_path):
    update_manifest(tmp_path, "a", {"shards": [1]})
    update_manifest(tmp_path, "b", {"shards": [2]})
    update_manifest(tmp_path, "a", {"shards": [3]})
    data = json.loads((tmp_path / "manifest.json").read_text())
    assert data["prefixes"] == {"a": {"shards": [3]}, "b": {"shards": [2]}}
    update_manifest(tmp_path, "a", None)
    assert list(read_manifest(tmp_path)["prefixes"]) == ["b"]
