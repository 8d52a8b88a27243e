import pytest
import torch

from dlm.model import masks


def grid(text: str) -> torch.Tensor:
    """Parse an ASCII picture ('x' allowed, '.' blocked, '|' ignored) into a bool [Q, K] tensor."""
    rows = [[c == "x" for c in line.split() if c in "x."] for line in text.strip().splitlines()]
    return torch.tensor(rows, dtype=torch.bool)


def d(mask_mod, B, Q, K=None):
    return masks.dense(mask_mod, B, Q, K)


def test_causal_and_full():
    assert torch.equal(d(masks.causal(), 1, 4)[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())
    assert d(masks.full(), 2, 3).all()
    assert d(masks.causal(), 2, 3).shape == (2, 1, 3, 3)


def test_doc_ids_and_key_padding():
    doc = torch.tensor([[0, 0, 1, 1, 1]])
    expect = grid("""
        x . . . .
        x x . . .
        . . x . .
        . . x x .
        . . x x x""")
    assert torch.equal(d(masks.causal(doc_ids=doc), 1, 5)[0, 0], expect)
    expect_full = grid("""
        x x . . .
        x x . . .
        . . x x x
        . . x x x
        . . x x x""")
    assert torch.equal(d(masks.full(doc_ids=doc), 1, 5)[0, 0], expect_full)
    # padding: keys 3, 4 of row 1 are pads; pad queries keep only their own diagonal (never an empty row)
    valid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    m = d(masks.full(key_valid=valid), 2, 5)
    assert m[0].all()
    assert torch.equal(
        m[1, 0],
        grid("""
        x x x . .
        x x x . .
        x x x . .
        x x x x .
        x x x . x"""),
    )
    assert m.any(-1).all()


def test_doc_positions():
    doc = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    assert masks.doc_positions(doc).tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]]


def test_annealed_p0_p1_and_one_draw():
    L = 6
    assert torch.equal(d(masks.annealed(L, 0.0), 1, L), d(masks.causal(), 1, L))
    assert d(masks.annealed(L, 1.0), 2, L).all()
    g = torch.Generator().manual_seed(0)
    m = d(masks.annealed(L, 0.5, g), 3, L)
    # one draw shared by the batch; causal part always allowed
    assert torch.equal(m[0], m[1]) and torch.equal(m[0], m[2])
    assert m[0, 0][torch.ones(L, L, dtype=torch.bool).tril()].all()
    # same seed -> same draw; the upper triangle follows the Bernoulli draw
    g2 = torch.Generator().manual_seed(0)
    draw = masks.draw_anneal(L, 0.5, g2)
    assert torch.equal(m[0, 0], torch.ones(L, L, dtype=torch.bool).tril() | draw)


def test_annealed_rate():
    # Bernoulli(p) above the diagonal: 200*199/2 = 19900 draws, sd of the rate = sqrt(.3*.7/19900) = 0.0032;
    # 5 sd = 0.016.
    L, p = 200, 0.3
    m = d(masks.annealed(L, p, torch.Generator().manual_seed(1)), 1, L)[0, 0]
    upper = m[torch.ones(L, L, dtype=torch.bool).triu(1)]
    assert abs(upper.float().mean().item() - p) < 0.016


BD_L4_B2 = """
    x x . . | . . . .
    x x . . | . . . .
    . . x x | x x . .
    . . x x | x x . .
    . . . . | x x . .
    . . . . | x x . .
    . . . . | x x x x
    . . . . | x x x x"""

ID_L4_B2 = """
    x . . . | . . . .
    x x . . | . . . .
    . . x . | x x . .
    . . x x | x x . .
    . . . . | x . . .
    . . . . | x x . .
    . . . . | x x x .
    . . . . | x x x x"""

ID_L4_B1 = """
    x . . . | . . . .
    . x . . | x . . .
    . . x . | x x . .
    . . . x | x x x .
    . . . . | x . . .
    . . . . | x x . .
    . . . . | x x x .
    . . . . | x x x x"""


def test_block_diffusion_pattern():
    assert torch.equal(d(masks.block_diffusion(4, 2), 1, 8)[0, 0], grid(BD_L4_B2))


def test_introspective_patterns():
    assert torch.equal(d(masks.introspective(4, 2), 1, 8)[0, 0], grid(ID_L4_B2))
    assert torch.equal(d(masks.introspective(4, 1), 1, 8)[0, 0], grid(ID_L4_B1))
    # b = 3 with L = 5: blocks {0,1,2},{3,4}
    m = d(masks.introspective(5, 3), 1, 10)[0, 0]
    assert m[3, 5:].tolist() == [True, True, True, False, False]  # noisy 3 sees clean 0..2
    assert m[4, :5].tolist() == [False, False, False, True, True]  # causal within its block
    assert m[2, :5].tolist() == [True, True, True, False, False] and not m[2, 5:].any()


def test_introspective_cached_equals_noisy_rows():
    for L, b in [(4, 1), (4, 2), (7, 3)]:
        full2 = d(masks.introspective(L, b), 1, 2 * L)[0, 0]
        cached = d(masks.introspective_cached(L, b), 1, L, 2 * L)[0, 0]
        # cached keys are [clean | noisy]; the full mask's noisy rows are [noisy | clean]
        assert torch.equal(cached, torch.cat([full2[:L, L:], full2[:L, :L]], dim=1))
    doc = torch.tensor([[0, 0, 0, 1, 1, 1]])
    valid = torch.tensor([[1, 1, 1, 1, 1, 0]])
    full2 = d(masks.introspective(6, 2, doc_ids=doc, key_valid=valid), 1, 12)[0, 0]
    cached = d(masks.introspective_cached(6, 2, doc_ids=doc, key_valid=valid), 1, 6, 12)[0, 0]
    assert torch.equal(cached, torch.cat([full2[:6, 6:], full2[:6, :6]], dim=1))


def test_two_half_masks_with_documents():
    # two documents of 3 tokens in one row; blocks restart at each document start (b = 2: {0,1},{2} per doc)
    doc = torch.tensor([[0, 0, 0, 1, 1, 1]])
    m = d(masks.introspective(6, 2, doc_ids=doc), 1, 12)[0, 0]
    # noisy query 3 (doc 1, pos 0, block 0) sees only itself
    assert m[3].nonzero().flatten().tolist() == [3]
    # noisy query 5 (doc 1, pos 2, block 1) sees itself and clean doc-1 tokens of block 0 (clean 3, 4)
    assert m[5].nonzero().flatten().tolist() == [5, 9, 10]
    # clean query 4 (= index 10) sees clean 3, 4 only
    assert m[10].nonzero().flatten().tolist() == [9, 10]
    bd = d(masks.block_diffusion(6, 2, doc_ids=doc), 1, 12)[0, 0]
    assert bd[2].nonzero().flatten().tolist() == [2, 6, 7]
    assert bd[4].nonzero().flatten().tolist() == [3, 4]
    assert bd[11].nonzero().flatten().tolist() == [9, 10, 11]
    assert m.any(-1).all() and bd.any(-1).all()


def test_per_row_doc_ids_differ():
    doc = torch.tensor([[0, 0, 0, 0], [0, 0, 1, 1]])
    m = d(masks.block_diffusion(4, 2, doc_ids=doc), 2, 8)
    assert torch.equal(m[0, 0], grid(BD_L4_B2))
    assert m[1, 0, 2].nonzero().flatten().tolist() == [2, 3]  # doc 1 starts at 2: block 0 of its doc


def test_decode_mask():
    valid = torch.tensor([[True, False, True], [True, True, True]])
    m = masks.decode_mask(valid, 2)
    assert m.shape == (2, 1, 2, 5)
    assert torch.equal(
        m[0, 0],
        grid("""
        x . x x .
        x . x x x"""),
    )
    assert m[1, 0, 1].all() and not m[1, 0, 0, 4]
    # a tree-shaped chunk's own attention (ISD's rejection branch F sees c only), for every row or per row
    tree = grid("""
        x . .
        x x .
        x . x""")
    m = masks.decode_mask(valid, 3, tree)
    assert m.shape == (2, 1, 3, 6) and torch.equal(m[0, 0, :, 3:], tree) and torch.equal(m[1, 0, :, 3:], tree)
    assert torch.equal(m[0, 0, :, :3], valid[0].expand(3, 3))
    per_row = torch.stack([tree, torch.ones(3, 3, dtype=torch.bool).tril()])
    m = masks.decode_mask(valid, 3, per_row)
    assert torch.equal(m[0, 0, :, 3:], tree) and torch.equal(m[1, 0, :, 3:], per_row[1])


def test_render():
    assert masks.render(torch.ones(2, 2, dtype=torch.bool).tril(), split=1) == "x | .\nx | x"


def _mods():
    g = torch.Generator().manual_seed(3)
    doc = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, 10:] = False
    L = 12
    return [
        ("causal", masks.causal(doc_ids=doc, key_valid=valid), L, L),
        ("full", masks.full(doc_ids=doc, key_valid=valid), L, L),
        ("annealed", masks.annealed(L, 0.4, g, doc_ids=doc, key_valid=valid), L, L),
        ("block", masks.block_diffusion(L, 3, doc_ids=doc, key_valid=valid), 2 * L, 2 * L),
        ("introspective", masks.introspective(L, 2, doc_ids=doc, key_valid=valid), 2 * L, 2 * L),
        ("cached", masks.introspective_cached(L, 2, doc_ids=doc, key_valid=valid), L, 2 * L),
    ]


def _flex_available():
    try:
        from torch.nn.attention.flex_attention import create_mask  # noqa: F401

        return True
    except Exception:  # pragma: no cover
        return False


def _flex_runs_here():
    """Whether torch's own flex attention runs on this platform (a probe with torch's own mask; dlm's masks are
    then tested without any exception turned into a skip)."""
    import warnings

    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        bm = create_block_mask(lambda b, h, q, k: q >= k, 1, None, 8, 8, device="cpu", BLOCK_SIZE=8)
        x = torch.zeros(1, 1, 8, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "called without torch.compile": expected on the CPU
            flex_attention(x, x, x, block_mask=bm)
        return True
    except Exception:  # pragma: no cover
        return False


@pytest.mark.skipif(not _flex_available(), reason="flex attention not available in this torch")
@pytest.mark.parametrize("name", ["causal", "full", "annealed", "block", "introspective", "cached"])
def test_flex_mask_matches_dense(name):
    """dlm's ``BlockMask`` (the flex-attention form used on CUDA) allows exactly the dense mask's pairs, and its
    block map marks exactly the blocks that hold an allowed pair (a skipped block would drop attention)."""
    from torch.nn.attention.flex_attention import create_mask

    mod, Q, K = {n: (m, q, k) for n, m, q, k in _mods()}[name]
    ref = masks.dense(mod, 2, Q, K)
    assert torch.equal(create_mask(mod, 2, 1, Q, K, device="cpu").bool(), ref)
    bs = 8
    bm = masks.block_mask(mod, 2, Q, K, device="cpu", block_size=bs)
    assert torch.equal(create_mask(bm.mask_mod, 2, 1, Q, K, device="cpu").bool(), ref)
    nq, nk = -(-Q // bs), -(-K // bs)
    padded = torch.zeros(2, 1, nq * bs, nk * bs, dtype=torch.bool)
    padded[..., :Q, :K] = ref
    occupied = padded.view(2, 1, nq, bs, nk, bs).any(5).any(3)
    assert torch.equal(bm.to_dense().bool(), occupied)


@pytest.mark.skipif(not _flex_available() or not _flex_runs_here(), reason="flex attention does not run here")
def test_flex_attention_output_matches_sdpa():
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    mod, Q, K = masks.introspective(12, 2, doc_ids=torch.tensor([[0] * 5 + [1] * 7])), 24, 24
    bm = masks.block_mask(mod, 1, Q, K, device="cpu", block_size=8)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, Q, 16) for _ in range(3))
    out = flex_attention(q, k, v, block_mask=bm)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=masks.dense(mod, 1, Q, K))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_rows_from_equals_slicing_the_dense_cached_mask():
    """The I-DLM split path's noisy pass starts at row ``start``: the shifted index function gives exactly the
    dense ``L x 2L`` mask with its first rows and noisy key columns cut away."""
    L = 9
    doc = torch.tensor([[0] * 4 + [1] * 5, [0] * 9])
    valid = torch.ones(2, L, dtype=torch.bool)
    valid[1, 7:] = False
    mod = masks.introspective_cached(L, 2, doc_ids=doc, key_valid=valid)
    full = masks.dense(mod, 2, L, 2 * L)
    for start in (0, 1, 4, 8):
        cut = torch.cat([full[:, :, start:, :L], full[:, :, start:, L + start :]], -1)
        assert torch.equal(masks.dense(masks.rows_from(mod, L, start), 2, L - start, 2 * L - start), cut), start
