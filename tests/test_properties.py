"""Property tests (hypothesis): the data path, the attention masks, ISD's acceptance rules and SFT prompt masking,
each checked against a definition written here, over inputs a machine picks.

Bounded: the default profile (tests/conftest.py) runs a dozen derandomized examples per property (a few seconds in
all); ``HYPOTHESIS_PROFILE=ci`` runs many more, freshly random ones.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_shards import spec_build, spec_read  # noqa: E402

from dlm.data.loader import CombinedDataset, PackedDataset  # noqa: E402
from dlm.data.shards import ShardWriter  # noqa: E402
from dlm.model import masks  # noqa: E402

CI = os.environ.get("HYPOTHESIS_PROFILE") == "ci"


def examples(fast: int, ci: int):
    return settings(max_examples=ci if CI else fast)


# ============================================================================================ shards and prepare
@examples(15, 300)
@given(
    docs=st.lists(st.lists(st.integers(1, 65535), max_size=40), min_size=1, max_size=12),
    chunk=st.integers(1, 37),
    dtype=st.sampled_from(["uint16", "int32"]),
    remainder=st.booleans(),
    eos=st.sampled_from([None, 0, 7]),
)
def test_writer_and_reader_round_trip_any_token_stream(tmp_path_factory, docs, chunk, dtype, remainder, eos):
    """Any documents, chunk size, dtype and EOS policy: ShardWriter's files are the reference builder's byte for
    byte, and the loader (one block per shard, no shuffle) reads back exactly the packed stream."""
    folder = tmp_path_factory.mktemp("rt")
    ref = folder / "ref"
    ref.mkdir()
    sep = 0
    stream = [t for d in docs for t in (d + ([eos] if eos is not None else []))]
    names = spec_build(stream, chunk, sep, "p", ref, dtype, write_remainder=remainder)
    w = ShardWriter(folder, "p", chunk, sep, np.dtype(dtype))
    for d in docs:
        w.add(np.asarray(d + ([eos] if eos is not None else []), dtype=np.int64))
    dropped = w.finish(remainder)
    assert [s["file"] for s in w.shards] == names
    for n in names:
        assert (folder / n).read_bytes() == (ref / n).read_bytes(), n
    kept = len(names) * chunk - (0 if not remainder or not names else (-len(stream)) % chunk)
    assert dropped == (0 if remainder else len(stream) - kept)
    if names:
        ds = PackedDataset([folder / n for n in names], chunk, shuffle=False)
        got = np.concatenate([b.numpy() for b in ds])
        expect = np.concatenate([spec_read(ref / n) for n in names])
        assert got.tolist() == expect.tolist()
        assert got[:kept].tolist() == stream[:kept]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from dlm.testing import make_tokenizer

    path = tmp_path_factory.mktemp("tok")
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "log", "To", "be", "or", "not", "0", "10", "!", "\n", "é"]
doc_text = st.lists(st.sampled_from(WORDS), min_size=0, max_size=25).map(" ".join)


class Killed(BaseException):
    """Stands in for SIGKILL: not an Exception, so nothing in dlm prepare catches or cleans up after it."""


def _write_sources(src: Path, files: list[list[str]], kinds: list[str]) -> None:
    src.mkdir()
    for i, (docs, kind) in enumerate(zip(files, kinds)):
        if kind == "txt":
            (src / f"f{i:02d}.txt").write_text(docs[0] if docs else "")
        else:
            (src / f"f{i:02d}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


def _expected_stream(tok, files, kinds, eos: bool) -> list[int]:
    out = []
    for docs, kind in zip(files, kinds):
        docs = docs[:1] if kind == "txt" else docs
        for d in docs:
            if not d.strip():
                continue  # a blank document is skipped (rows_skipped['empty'])
            out += tok(d)["input_ids"] + ([tok.eos_token_id] if eos else [])
    return out


def _shard_bytes(folder: Path, prefix: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob(f"{prefix}_*.bin"))}


source_files = st.lists(st.lists(doc_text, min_size=1, max_size=6), min_size=1, max_size=4)


@examples(10, 150)
@given(
    files=source_files,
    data=st.data(),
    chunk=st.integers(3, 60),
    dtype=st.sampled_from(["uint16", "int32"]),
    eos=st.booleans(),
    remainder=st.booleans(),
)
def test_prepare_round_trips_any_documents(tmp_path_factory, tok_dir, tok, files, data, chunk, dtype, eos, remainder):
    """``dlm prepare`` on any JSONL/txt documents: the shards are the reference builder's over the per-document
    tokens (+ EOS), byte for byte, and the loader reads the same tokens back."""
    from dlm.data.prepare import PrepareConfig, prepare
    from dlm.errors import DLMError

    kinds = data.draw(st.lists(st.sampled_from(["jsonl", "txt"]), min_size=len(files), max_size=len(files)))
    root = tmp_path_factory.mktemp("prep")
    _write_sources(root / "src", files, kinds)
    stream = _expected_stream(tok, files, kinds, eos)
    ref = root / "ref"
    ref.mkdir()
    names = spec_build(stream, chunk, tok.eos_token_id, "train", ref, dtype, write_remainder=remainder)
    cfg = PrepareConfig(
        source_path=str(root / "src"),
        destination_path=str(root / "out"),
        tokenizer=str(tok_dir),
        chunk_size=chunk,
        dtype=dtype,
        eos=eos,
        write_remainder=remainder,
        progress=False,
    )
    if not names:
        with pytest.raises(DLMError, match="--write-remainder|no documents"):
            prepare(cfg)
        assert not (root / "out").exists() or not _shard_bytes(root / "out", "train")
        return
    prepare(cfg)
    assert _shard_bytes(root / "out", "train") == _shard_bytes(ref, "train")
    ds = PackedDataset(sorted((root / "out").glob("train_*.bin")), chunk, shuffle=False)
    got = np.concatenate([b.numpy() for b in ds]).tolist()
    assert got[: len(stream)] == stream[: len(got)]


@examples(10, 150)
@given(
    # documents with a word in them: a run of blank documents only is refused before any write (tested above)
    files=st.lists(st.lists(doc_text.filter(str.strip), min_size=1, max_size=5), min_size=2, max_size=4),
    chunk=st.integers(3, 30),
    kill_at=st.integers(0, 40),
    partial=st.booleans(),
    remainder=st.booleans(),
)
def test_prepare_killed_anywhere_then_rerun_gives_the_same_shards(
    tmp_path_factory, tok_dir, files, chunk, kill_at, partial, remainder
):
    """A prepare killed at the ``kill_at``-th write (a shard, a worker checkpoint or the manifest; with
    ``partial`` the killed write leaves half a temp file behind) and rerun ends with the uninterrupted shards."""
    import dlm.data.prepare as prep
    import dlm.data.shards as shards
    from dlm.data.prepare import PrepareConfig, prepare

    root = tmp_path_factory.mktemp("kill")
    _write_sources(root / "src", files, ["jsonl"] * len(files))

    def cfg(dest):
        return PrepareConfig(
            source_path=str(root / "src"),
            destination_path=str(root / dest),
            tokenizer=str(tok_dir),
            chunk_size=chunk,
            write_remainder=True,
            progress=False,
        )

    prepare(cfg("ref"))
    writes = [0]
    real_shard, real_state, real_manifest = shards.write_shard, prep._save_state, prep.update_manifest

    def maybe_kill(tmp: Path | None, payload: bytes):
        writes[0] += 1
        if writes[0] == kill_at + 1:
            if partial and tmp is not None:
                tmp.write_bytes(payload[: len(payload) // 2])
            raise Killed()

    def shard(path, tokens):
        path = Path(path)
        maybe_kill(path.with_name(f".{path.name}.tmp"), np.ascontiguousarray(tokens).tobytes())
        return real_shard(path, tokens)

    def state(path, st_, pending):
        maybe_kill(path.with_name(path.name + ".tmp"), json.dumps(st_).encode())
        return real_state(path, st_, pending)

    def manifest(folder, prefix, entry):
        maybe_kill(None, b"")
        return real_manifest(folder, prefix, entry)

    mp = pytest.MonkeyPatch()
    mp.setattr(shards, "write_shard", shard)
    mp.setattr(prep, "_save_state", state)
    mp.setattr(prep, "update_manifest", manifest)
    try:
        try:
            prepare(cfg("out"))
        except Killed:
            pass
    finally:
        mp.undo()
    summary = prepare(cfg("out"))
    assert _shard_bytes(root / "out", "train") == _shard_bytes(root / "ref", "train")
    assert not [p.name for p in (root / "out").iterdir() if p.name.endswith(".tmp") or p.is_dir()]
    entry = json.loads((root / "out" / "manifest.json").read_text())["prefixes"]["train"]
    ref_entry = json.loads((root / "ref" / "manifest.json").read_text())["prefixes"]["train"]
    assert entry["shards"] == ref_entry["shards"] and entry["sources"] == ref_entry["sources"]
    assert summary["tokens"] == ref_entry["totals"]["tokens"]


# ============================================================================================ loader
CH, BL = 12, 4  # 3 blocks per file


def _files(folder: Path, n: int, base: int = 0) -> list[Path]:
    from dlm.data.shards import write_shard

    folder.mkdir(exist_ok=True)
    out = []
    for i in range(n):
        p = folder / f"d{base}_{i:010d}.bin"
        write_shard(p, (np.arange(CH) + (base + i) * 100).astype(np.int32))
        out.append(p)
    return out


def _bid(block) -> tuple[int, int]:
    return int(block[0]) // 100, (int(block[0]) % 100) // BL


class _Worker:
    def __init__(self, wid, n):
        self.id, self.num_workers = wid, n


def _consumer_stream(mp, files, rank, world, wid, workers, **kw):
    """The blocks dataloader worker ``wid`` of rank ``rank`` reads (get_worker_info as inside that worker)."""
    import dlm.data.loader as loader

    mp.setattr(loader, "get_worker_info", lambda: _Worker(wid, workers))
    ds = PackedDataset(files, BL, rank=rank, world_size=world, **kw)
    return ds, iter(ds)


layouts = st.integers(1, 4).flatmap(
    lambda w: st.integers(1, 3).flatmap(lambda k: st.tuples(st.just(w), st.just(k), st.integers(w * k, w * k + 9)))
)


@examples(20, 400)
@given(layout=layouts, n_chunks=st.integers(1, 5), seed=st.integers(0, 2**31), shuffle=st.booleans())
def test_every_block_once_per_epoch_for_any_topology(tmp_path_factory, layout, n_chunks, seed, shuffle):
    """Any file count, world size and worker count: over the consumers, each of epochs 0, 1 and 2 reads every
    block exactly once (consumer c's epoch e holds the files at positions (c + e) % C, + C, ... of that epoch's
    permutation, docs/data.md)."""
    world, workers, n = layout
    files = _files(tmp_path_factory.mktemp("ld"), n)
    C = world * workers
    every = Counter((f, b) for f in range(n) for b in range(CH // BL))
    epochs = [Counter() for _ in range(3)]
    mp = pytest.MonkeyPatch()
    try:
        for rank in range(world):
            for wid in range(workers):
                c = rank * workers + wid
                _, it = _consumer_stream(
                    mp, files, rank, world, wid, workers, n_chunks=n_chunks, seed=seed, shuffle=shuffle, wrap=True
                )
                for e in range(3):
                    count = len(range((c + e) % C, n, C)) * (CH // BL)
                    epochs[e].update(_bid(next(it)) for _ in range(count))
    finally:
        mp.undo()
    for e in range(3):
        assert epochs[e] == every, e


@examples(20, 400)
@given(layout=layouts, n_chunks=st.integers(1, 5), seed=st.integers(0, 2**31), data=st.data())
def test_state_dict_resumes_to_the_identical_next_block(tmp_path_factory, layout, n_chunks, seed, data):
    """Any consumer, any cut point (across windows and epochs): a fresh dataset given ``state_dict()`` yields
    exactly what the uninterrupted one yields next."""
    world, workers, n = layout
    files = _files(tmp_path_factory.mktemp("rs"), n)
    rank = data.draw(st.integers(0, world - 1))
    wid = data.draw(st.integers(0, workers - 1))
    cut = data.draw(st.integers(0, 3 * n * (CH // BL)))
    mp = pytest.MonkeyPatch()
    try:
        kw = dict(n_chunks=n_chunks, seed=seed, wrap=True)
        ds, it = _consumer_stream(mp, files, rank, world, wid, workers, **kw)
        ref = [next(it).tolist() for _ in range(cut + 8)]
        ds2, it2 = _consumer_stream(mp, files, rank, world, wid, workers, **kw)
        for _ in range(cut):
            next(it2)
        state = json.loads(json.dumps(ds2.state_dict()))  # what a checkpoint stores
        ds3, _ = _consumer_stream(mp, files, rank, world, wid, workers, **kw)
        ds3.load_state_dict(state)
        it3 = iter(ds3)
        assert [next(it3).tolist() for _ in range(8)] == ref[cut:]
    finally:
        mp.undo()


@examples(10, 200)
@given(
    weights=st.lists(st.floats(0.05, 1.0), min_size=2, max_size=3), seed=st.integers(0, 2**31), cut=st.integers(0, 60)
)
def test_mixture_resumes_to_the_identical_next_block(tmp_path_factory, weights, seed, cut):
    root = tmp_path_factory.mktemp("mix")
    make = lambda: CombinedDataset(
        [
            PackedDataset(
                _files(root / f"s{i}", 3, base=10 * i),
                BL,
                seed=seed + i,  # noqa
                wrap=True,
                rank=0,
                world_size=1,
            )
            for i in range(len(weights))
        ],
        weights,
        seed=seed,
    )
    a = iter(make())
    ref = [next(a).tolist() for _ in range(cut + 6)]
    b = make()
    it = iter(b)
    for _ in range(cut):
        next(it)
    c = make()
    c.load_state_dict(json.loads(json.dumps(b.state_dict())))
    it3 = iter(c)
    assert [next(it3).tolist() for _ in range(6)] == ref[cut:]


# ============================================================================================ masks
def _pos(doc, i):
    """Position of i inside its document (brute force)."""
    j = i
    while j > 0 and doc[j - 1] == doc[i]:
        j -= 1
    return i - j


def brute(kind: str, L: int, bs: int, doc, valid, draw=None, start=0):
    """The masks of docs/algorithms.md written as loops: allowed[q][k] for one batch row."""
    same = lambda i, j: doc is None or doc[i] == doc[j]
    blk = lambda i: (i if doc is None else _pos(doc, i)) // bs
    if kind in ("causal", "full", "annealed"):
        Q = K = L
    elif kind in ("block_diffusion", "introspective"):
        Q = K = 2 * L
    else:  # introspective_cached, rows_from
        Q, K = L, 2 * L
    out = [[False] * K for _ in range(Q)]
    for q in range(Q):
        for k in range(K):
            if kind == "causal":
                a = k <= q and same(q, k)
            elif kind == "full":
                a = same(q, k)
            elif kind == "annealed":
                a = (k <= q or bool(draw[q][k])) and same(q, k)
            elif kind in ("block_diffusion", "introspective"):
                qn, kn = q < L, k < L
                qi, ki = q % L, k % L
                if qn and kn:
                    a = blk(qi) == blk(ki) and (kind == "block_diffusion" or ki <= qi)
                elif qn and not kn:
                    a = blk(ki) < blk(qi)
                elif not qn and not kn:
                    a = blk(ki) <= blk(qi) if kind == "block_diffusion" else ki <= qi
                else:
                    a = False
                a = a and same(qi, ki)
            else:  # keys [clean 0..L-1 | noisy 0..L-1], queries noisy
                ki = k % L
                if k < L:
                    a = blk(ki) < blk(q)
                else:
                    a = blk(ki) == blk(q) and ki <= q
                a = a and same(q, ki)
            if valid is not None:
                own = (k == q) if kind not in ("introspective_cached",) else (k == q + L)
                a = a and (bool(valid[k % L]) or own)
            out[q][k] = a
    t = torch.tensor(out, dtype=torch.bool)
    if kind == "introspective_cached" and start:
        t = torch.cat([t[start:, :L], t[start:, L + start :]], dim=1)
    return t


def _make(kind, L, bs, doc_t, valid_t, draw):
    kw = dict(doc_ids=doc_t, key_valid=valid_t)
    if kind == "causal":
        return masks.causal(**kw)
    if kind == "full":
        return masks.full(**kw)
    if kind == "annealed":
        return masks.annealed(L, 0.5, draw=draw, **kw)
    return getattr(masks, kind)(L, bs, **kw)


def _dims(kind, L):
    return {
        "causal": (L, L),
        "full": (L, L),
        "annealed": (L, L),
        "block_diffusion": (2 * L, 2 * L),
        "introspective": (2 * L, 2 * L),
        "introspective_cached": (L, 2 * L),
    }[kind]


KINDS = ["causal", "full", "annealed", "block_diffusion", "introspective", "introspective_cached"]


@st.composite
def mask_case(draw, kind=None, batch=None, docs=None):
    kind = kind or draw(st.sampled_from(KINDS))
    L = draw(st.integers(1, 12))
    bs = draw(st.integers(1, 5))
    B = batch or draw(st.integers(1, 2))
    with_docs = draw(st.booleans()) if docs is None else docs
    docs = (
        [draw(st.lists(st.integers(0, 2), min_size=L, max_size=L).map(sorted)) for _ in range(B)] if with_docs else None
    )
    valid = [draw(st.lists(st.booleans(), min_size=L, max_size=L)) for _ in range(B)] if draw(st.booleans()) else None
    anneal = draw(st.lists(st.lists(st.booleans(), min_size=L, max_size=L), min_size=L, max_size=L))
    start = draw(st.integers(0, L - 1))
    return kind, L, bs, B, docs, valid, anneal, start


@examples(40, 800)
@given(case=mask_case())
def test_dense_masks_equal_the_brute_force_definition(case):
    kind, L, bs, B, docs, valid, anneal, start = case
    doc_t = torch.tensor(docs) if docs is not None else None
    valid_t = torch.tensor(valid) if valid is not None else None
    draw_t = torch.tensor(anneal)
    mm = _make(kind, L, bs, doc_t, valid_t, draw_t)
    Q, K = _dims(kind, L)
    got = masks.dense(mm, B, Q, K)
    assert got.shape == (B, 1, Q, K)
    for b in range(B):
        want = brute(kind, L, bs, docs[b] if docs else None, valid[b] if valid else None, anneal)
        assert torch.equal(got[b, 0], want), (b, "\n" + masks.render(got[b, 0]) + "\n\n" + masks.render(want))
    if kind == "introspective_cached" and start:
        got = masks.dense(masks.rows_from(mm, L, start), B, L - start, 2 * L - start)
        for b in range(B):
            want = brute(kind, L, bs, docs[b] if docs else None, valid[b] if valid else None, start=start)
            assert torch.equal(got[b, 0], want)


@examples(2, 50)
@given(data=st.data())
def test_flex_block_masks_equal_the_brute_force_definition(data):
    """The flex-attention form of every mask (batch of 2): ``block_mask`` (block sparsity + mask_mod) run through
    flex attention with zero scores and one-hot values recovers exactly the allowed keys of every query."""
    for kind in KINDS:
        _check_flex(data.draw(mask_case(kind=kind, batch=2, docs=True)))


def _check_flex(case):
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    kind, L, bs, B, docs, valid, anneal, start = case
    doc_t = torch.tensor(docs) if docs is not None else None
    valid_t = torch.tensor(valid) if valid is not None else None
    mm = _make(kind, L, bs, doc_t, valid_t, torch.tensor(anneal))
    Q, K = _dims(kind, L)
    bm = masks.block_mask(mm, B, Q, K, block_size=4)
    D = 32
    q = torch.zeros(B, 1, Q, D)
    k = torch.zeros(B, 1, K, D)
    v = torch.zeros(B, 1, K, D)
    v[:, 0, torch.arange(K), torch.arange(K)] = 1.0
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fa.flex_attention(q, k, v, block_mask=bm)
    for b in range(B):
        want = brute(kind, L, bs, docs[b] if docs else None, valid[b] if valid else None, anneal)
        assert torch.equal(out[b, 0, :, :K] > 0, want), (kind, b)


@examples(15, 300)
@given(valid=st.lists(st.booleans(), min_size=0, max_size=8), q_len=st.integers(1, 5))
def test_decode_mask_equals_the_brute_force_definition(valid, q_len):
    got = masks.decode_mask(torch.tensor([valid], dtype=torch.bool).reshape(1, len(valid)), q_len)[0, 0]
    want = [
        [(valid[k] if k < len(valid) else (k - len(valid)) <= q) for k in range(len(valid) + q_len)]
        for q in range(q_len)
    ]
    assert got.tolist() == want


@examples(30, 600)
@given(
    rows=st.lists(
        st.lists(st.sampled_from([float("-inf"), -1.0, 0.0, 0.5, 2.0]), min_size=6, max_size=6), min_size=1, max_size=4
    ),
    mask=st.sampled_from([None, -1, 0, 1, 3, 5, 6]),
    dims=st.integers(1, 3),
)
def test_greedy_argmax_is_the_first_maximal_token_but_the_mask(rows, mask, dims):
    """The greedy token, read without copying the logits (argmax_no_mask: the two sides of the mask column), is the
    first index of the largest logit among the tokens that are not the mask token - ties on either side of it, a
    mask first or last, no mask, a row that is all -inf but the mask (never the mask token, which the argmax of the
    suppressed logits would give there) - for 1-, 2- and 3-d logits."""
    from dlm.decode.sampling import argmax_no_mask

    def first_max(row):
        keep = [j for j in range(len(row)) if j != mask]
        best = max(row[j] for j in keep)
        return next(j for j in keep if row[j] == best)

    x = torch.tensor(rows)
    want = torch.tensor([first_max(r) for r in rows])
    if dims == 1:
        x, want = x[0], want[0]
    elif dims == 3:
        x, want = x[None].expand(2, *x.shape), want[None].expand(2, *want.shape)
    assert torch.equal(argmax_no_mask(x, mask), want)


# ============================================================================================ ISD acceptance rules
V = 5
N_DRAWS = 4000 if CI else 2000


@st.composite
def dist(draw, support_min=1):
    """A probability vector over V tokens with some exact zeros."""
    w = draw(st.lists(st.sampled_from([0.0, 0.0, 0.05, 0.2, 0.5, 1.0, 3.0]), min_size=V, max_size=V))
    if sum(w) == 0:
        w[draw(st.integers(0, V - 1))] = 1.0
    t = torch.tensor(w, dtype=torch.float32)
    return t / t.sum()


def assert_distributed_as(counts: Counter, p: torch.Tensor, n: int, what: str):
    """Every token's frequency within 5 standard errors (+1/n) of p; a token with p = 0 is never emitted.

    With V = 5 cells per check the chance of a false alarm is below 1e-5 per check."""
    for t in range(p.shape[0]):
        pt = float(p[t])
        f = counts.get(t, 0) / n
        if pt == 0.0:
            assert counts.get(t, 0) == 0, (what, t, p.tolist(), counts)
            continue
        se = (max(pt * (1 - pt), 1.0 / n) / n) ** 0.5
        assert abs(f - pt) <= 5 * se + 1.0 / n, (what, t, f, pt, p.tolist(), sorted(counts.items()))


@examples(12, 200)
@given(p=dist(), q=dist(), seed=st.integers(0, 2**31))
def test_single_draft_rule_emits_p(p, q, seed):
    """d ~ q, then accept_or_correct: the emitted token (d or the correction) ~ p, for any p, q."""
    from dlm.decode.isd import accept_or_correct

    g = torch.Generator().manual_seed(seed)
    ds = torch.multinomial(q, N_DRAWS, replacement=True, generator=g).tolist()
    us = torch.rand(N_DRAWS, generator=g).tolist()
    counts = Counter()
    for d, u in zip(ds, us):
        c = accept_or_correct(p, q, d, u, g)
        counts[d if c is None else c] += 1
    assert_distributed_as(counts, p, N_DRAWS, "single draft")


@examples(6, 200)
@given(p=dist(), q=dist(), k=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_candidate_rule_emits_p(p, q, k, seed):
    """K candidates drawn from q without replacement, then recursive rejection (with its all-rejected residual
    draw): the token ~ p."""
    from dlm.decode.isd import draws_without_replacement, recursive_rejection

    g = torch.Generator().manual_seed(seed)
    firsts = torch.multinomial(q, N_DRAWS, replacement=True, generator=g).tolist()
    counts, rejected_all = Counter(), 0
    for first in firsts:
        cands = draws_without_replacement(q, first, k, g)
        hit, tok = recursive_rejection(p, q, cands, g)
        if hit is not None:
            assert tok == cands[hit]
        rejected_all += hit is None
        counts[tok] += 1
    assert_distributed_as(counts, p, N_DRAWS, f"candidates k={k}")


@examples(5, 150)
@given(p1=dist(), q1=dist(), p2=dist(), q2=dist(), q_fb=dist(), seed=st.integers(0, 2**31))
def test_fallback_draft_after_a_rejection_keeps_the_joint_distribution(p1, q1, p2, q2, q_fb, seed):
    """Two positions: d1 ~ q1 verified against p1; the next draft comes from q2 after an acceptance but from the
    fallback branch's q_fb after a rejection, and is verified against p2. The pair emitted ~ p1 x p2: choosing
    the proposal by the earlier outcome does not bias the tokens."""
    from dlm.decode.isd import accept_or_correct

    g = torch.Generator().manual_seed(seed)
    counts = Counter()
    n = N_DRAWS
    d1s = torch.multinomial(q1, n, replacement=True, generator=g).tolist()
    for d1 in d1s:
        c = accept_or_correct(p1, q1, d1, float(torch.rand(1, generator=g)), g)
        t1 = d1 if c is None else c
        qq = q2 if c is None else q_fb
        d2 = int(torch.multinomial(qq, 1, generator=g))
        c2 = accept_or_correct(p2, qq, d2, float(torch.rand(1, generator=g)), g)
        counts[t1 * V + (d2 if c2 is None else c2)] += 1
    joint = (p1[:, None] * p2[None, :]).reshape(-1)
    for t in range(V * V):  # the 25-cell joint: 5 standard errors per cell
        pt, f = float(joint[t]), counts.get(t, 0) / n
        if pt == 0.0:
            assert counts.get(t, 0) == 0
            continue
        se = (max(pt * (1 - pt), 1.0 / n) / n) ** 0.5
        assert abs(f - pt) <= 5 * se + 1.0 / n, (t, f, pt)


# ============================================================================================ SFT prompt masking
LLAMA_LIKE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}<<SYS>>{{ m['content'] }}<</SYS>>"
    "{% elif m['role'] == 'assistant' %} {{ m['content'] }}</s>"
    "{% else %}[INST] {{ m['content'] }} [/INST]{% endif %}{% endfor %}"
)


def _pieces(template: str, messages, eos: str):
    """(text, trained) pieces of a conversation under each template, written from the templates' meaning: only
    an assistant turn's own text and its end marker are trained; everything after the last assistant turn is
    dropped."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    out = []
    for m in messages[: last + 1]:
        role, c = m["role"], m["content"]
        if template == "chatml":
            if role == "assistant":
                out += [("<|im_start|>assistant\n", False), (c + "<|im_end|>\n", True)]
            else:
                out.append((f"<|im_start|>{role}\n{c}<|im_end|>\n", False))
        elif template == "fallback":
            if role == "assistant":
                out += [("Assistant: ", False), (c + eos + "\n", True)]
            else:
                out.append((f"{role.capitalize()}: {c}\n", False))
        else:
            if role == "assistant":
                out.append((f" {c}</s>", True))
            elif role == "system":
                out.append((f"<<SYS>>{c}<</SYS>>", False))
            else:
                out.append((f"[INST] {c} [/INST]", False))
    return out


sft_words = st.lists(st.sampled_from(["cat", "dog", "sat", "0", "1", "the", "mat", ".", "?", "To be"]), max_size=8).map(
    " ".join
)


@st.composite
def conversation(draw):
    msgs = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(sft_words)})
    for _ in range(draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": draw(sft_words)})
        msgs.append({"role": "assistant", "content": draw(sft_words)})
        if draw(st.booleans()):  # a second assistant turn in a row, or a user turn left at the end
            msgs.append({"role": draw(st.sampled_from(["assistant", "user"])), "content": draw(sft_words)})
    return msgs


def _as_layout(msgs, layout):
    if layout == "sharegpt":
        speaker = {"user": "human", "assistant": "gpt", "system": "system"}
        return {"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in msgs]}
    if layout == "prompt_response" and [m["role"] for m in msgs if m["role"] != "system"] == ["user", "assistant"]:
        rec = {"prompt": msgs[-2]["content"], "response": msgs[-1]["content"]}
        if msgs[0]["role"] == "system" and msgs[0]["content"]:
            rec["system"] = msgs[0]["content"]
        elif msgs[0]["role"] == "system":
            msgs.pop(0)  # an empty system field is left out of this layout
        return rec
    return {"messages": msgs}


@examples(25, 400)
@given(
    msgs=conversation(),
    layout=st.sampled_from(["openai", "sharegpt", "prompt_response"]),
    template=st.sampled_from(["chatml", "fallback", "llama"]),
    cut=st.one_of(st.none(), st.integers(1, 80)),
)
def test_sft_labels_are_ignored_exactly_on_prompt_tokens(tiny_tokenizer, msgs, layout, template, cut):
    from dlm.data.sft import IGNORE_INDEX, record_to_messages, tokenize_messages

    tok = tiny_tokenizer
    saved = tok.chat_template
    tok.chat_template = {"chatml": saved, "fallback": None, "llama": LLAMA_LIKE}[template]
    try:
        rec = _as_layout([dict(m) for m in msgs], layout)
        norm = record_to_messages(rec)
        ex = tokenize_messages(norm, tok, max_length=cut)
    finally:
        tok.chat_template = saved
    pieces = _pieces(template, norm, tok.eos_token)
    text = "".join(t for t, _ in pieces)
    trained_chars = [tr for t, tr in pieces for _ in t]
    ids, labels = ex["input_ids"], ex["labels"]
    full = tok("".join(t for t, _ in pieces), add_special_tokens=False)["input_ids"]  # noqa: F841 (length bound)
    assert len(ids) == len(labels)
    at = 0
    for i, (t, lab) in enumerate(zip(ids, labels)):
        piece = tok.decode([t])
        assert text[at : at + len(piece)] == piece, (i, piece, text[at : at + 20])
        flags = set(trained_chars[at : at + len(piece)])
        assert len(flags) == 1, (i, piece)  # no token straddles a prompt/answer boundary
        assert lab == (t if flags.pop() else IGNORE_INDEX), (i, piece, lab)
        at += len(piece)
    if cut is None:
        assert at == len(text)  # every token of the conversation is there
    else:
        assert len(ids) == min(cut, len(ids)) and (at == len(text) or len(ids) == cut)


# ============================================================================================ sampling
@examples(30, 500)
@given(
    logits=st.lists(st.floats(-1e4, 1e4), min_size=2, max_size=8),
    temperature=st.one_of(st.sampled_from([5e-324, 1e-300, 1e-30, 1e-8]), st.floats(1e-6, 2.0)),
    top_p=st.one_of(st.sampled_from([5e-324, 1e-300, 1e-8]), st.floats(1e-6, 1.0)),
    top_k=st.integers(0, 9),
)
def test_sampling_distribution_is_a_distribution_for_any_settings(logits, temperature, top_p, top_k):
    """Any temperature in (0, 2], top_p in (0, 1] and top_k: finite probabilities summing to 1 that keep the most
    likely token (a server request with top_p=5e-324 once made them NaN and failed the engine step)."""
    from dlm.decode.sampling import SamplingParams, probs_from_logits

    t = torch.tensor(logits)
    p = probs_from_logits(t, SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k), None)
    assert torch.isfinite(p).all() and (p >= 0).all(), p
    assert abs(float(p.sum()) - 1.0) < 1e-5
    assert float(p[int(t.argmax())]) > 0


# ============================================================================================ tool calls
_TEXT = st.text(alphabet=st.sampled_from(list('ab <>/_tolc{}"\n ')), max_size=12).filter(
    lambda s: "<tool_call>" not in s
)
_ARGS = st.dictionaries(st.sampled_from(["city", "n", "x"]), st.one_of(st.integers(-9, 99), _TEXT), max_size=3)


@examples(25, 400)
@given(
    parts=st.lists(st.one_of(_TEXT, st.tuples(st.sampled_from(["now", "get_weather"]), _ARGS)), max_size=6),
    layout=st.sampled_from(["{b}", "\n{b}\n"]),
    cuts=st.lists(st.integers(0, 400), max_size=8),
)
def test_hermes_answers_read_the_same_however_streamed(parts, layout, cuts):
    """An answer of text and ``<tool_call>`` blocks in any order: its calls, in order, and its text - each stretch
    with the whitespace before a call (and, after the last call, at the end) left out - the same whether read
    whole or fed in pieces cut anywhere."""
    from dlm.serve.tool_calls import Call, read_all, reader

    stretches: list = []  # adjacent text parts are one stretch of text
    for p in parts:
        if isinstance(p, str) and stretches and isinstance(stretches[-1], str):
            stretches[-1] += p
        else:
            stretches.append(p)
    hypothesis.assume(not any(isinstance(p, str) and "<tool_call>" in p for p in stretches))
    called = any(not isinstance(p, str) for p in stretches)
    text, want, content = "", [], ""
    for i, p in enumerate(stretches):
        if isinstance(p, str):
            before_call = i + 1 < len(stretches)  # stretches alternate: the next one is a call
            content += p.rstrip() if before_call or called else p
            text += p
        else:
            body = json.dumps({"name": p[0], "arguments": p[1]}, ensure_ascii=False)
            text += "<tool_call>" + layout.format(b=body) + "</tool_call>"
            want.append(Call(p[0], json.dumps(p[1], ensure_ascii=False)))
    whole = read_all(reader("hermes", frozenset({"now", "get_weather"})), text)[:2]
    assert whole == (content, want)
    r = reader("hermes", frozenset({"now", "get_weather"}))
    pieces, bounds = [], [0, *sorted(min(c, len(text)) for c in cuts), len(text)]
    for a, b in zip(bounds, bounds[1:]):
        pieces += r.feed(text[a:b])
    pieces += r.finish()
    got_calls = [v for k, v in pieces if k == "call"]
    assert "".join(v for k, v in pieces if k == "content") == whole[0] and got_calls == want


# ============================================================================================ prefix cache
@examples(25, 400)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 2), min_size=1, max_size=24)), min_size=1, max_size=30
    ),
    budget=st.sampled_from([12, 40, 10_000]),
    min_tokens=st.integers(1, 5),
)
def test_prefix_cache_answers_the_longest_stored_prefix_with_its_kv(ops, budget, min_tokens):
    """Any mix of stores and lookups (three token values, so prompts share beginnings and split the tree's runs
    everywhere): a lookup answers a stored prefix with exactly its tokens' KV - without eviction the longest one of
    any stored prompt (all but its last token), at least ``min_tokens`` and short of the whole prompt; a prompt
    just stored is found whole; the tokens kept are within the budget and counted once."""
    from test_decode_engine import spelled_kv

    from dlm.decode.prefix import PrefixCache

    cache = PrefixCache(max_tokens=budget, min_tokens=min_tokens)
    stored: list[list[int]] = []

    def lcp(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    for is_store, seq in ops:
        if is_store:
            cache.store(seq, spelled_kv(seq, layers=1))
            if min_tokens <= len(seq) - 1 <= budget:
                stored.append(seq[:-1])
                got = cache.lookup(seq[:-1] + [9])
                assert got is not None and got[0] == len(seq) - 1
        else:
            got = cache.lookup(seq)
            best = max((lcp(seq[:-1], s) for s in stored), default=0)
            if budget == 10_000:  # nothing was evicted
                assert (got is None) == (best < min_tokens) and (got is None or got[0] == best)
            if got is not None:
                c, ((k, v),) = got
                assert min_tokens <= c <= best and c < len(seq)
                ((wk, wv),) = spelled_kv(seq[:c], layers=1)
                assert torch.equal(k, wk) and torch.equal(v, wv)
        kept = sum(len(n.tokens) for n in cache._nodes())
        assert kept == cache.stored_tokens <= budget
        assert all(n.kv[0][0].shape[2] == len(n.tokens) for n in cache._nodes())
