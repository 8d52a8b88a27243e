"""Every attention mask dlm uses, as a pure function of indices.

Each public factory returns a ``mask_mod(b, h, q_idx, kv_idx) -> bool`` in the flex-attention style (True = the
query may attend to the key). The same function builds

- a dense boolean ``[B, 1, Q, K]`` tensor for SDPA / eager attention (:func:`dense`), used on CPU, and
- a flex-attention ``BlockMask`` (:func:`block_mask`), used on CUDA.

Index functions only use tensor operations that broadcast (``&``, ``|``, ``where``, indexing captured tensors),
so they work both under :func:`dense` (broadcast index grids) and under flex attention's ``vmap``.

Common options:

- ``doc_ids``: LongTensor ``[B, L]``, the document index of every token of a packed row; attention never crosses
  documents. For the ``[x_t | x0]`` masks (length 2L) it describes one half and applies to both.
- ``key_valid``: BoolTensor ``[B, L]`` (1/True = real token, 0/False = padding); padded keys are never attended.
  A query always keeps its own diagonal so that a padded query row is never empty (SDPA would return NaN there);
  real queries are unaffected because their own key is real.
- ``block_size`` masks compute ``block(i) = pos(i) // b`` where ``pos`` restarts at 0 at every document start
  (with no ``doc_ids``, ``pos(i) = i``), so blocks line up with documents the way decoding sees them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

__all__ = [
    "MaskMod",
    "causal",
    "full",
    "annealed",
    "block_diffusion",
    "introspective",
    "introspective_cached",
    "dense",
    "block_mask",
    "build",
    "rows_from",
    "decode_mask",
    "doc_positions",
    "draw_anneal",
    "render",
]


# -- helpers ----------------------------------------------------------------------------------------------------
def doc_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Position of every token inside its document: ``[B, L]`` long, restarting at 0 where ``doc_ids`` changes."""
    B, L = doc_ids.shape
    idx = torch.arange(L, device=doc_ids.device).expand(B, L)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def _wrap(base: MaskMod, L: int | None, doc_ids, key_valid) -> MaskMod:
    """Add document separation and key padding to ``base``; indices are reduced modulo L (one half)."""
    if doc_ids is None and key_valid is None:
        return base
    doc = doc_ids.long() if doc_ids is not None else None
    valid = key_valid.bool() if key_valid is not None else None

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = base(b, h, q_idx, kv_idx)
        qi = q_idx % L if L is not None else q_idx
        ki = kv_idx % L if L is not None else kv_idx
        if doc is not None:
            allowed = allowed & (doc[b, qi] == doc[b, ki])
        if valid is not None:
            allowed = allowed & (valid[b, ki] | (q_idx == kv_idx))
        return allowed

    return mask_mod


def _blocks(L: int, block_size: int, doc_ids: torch.Tensor | None, device=None) -> torch.Tensor:
    """``[B or 1, L]`` block index of every position of one half."""
    if doc_ids is None:
        return (torch.arange(L, device=device) // block_size)[None]
    return doc_positions(doc_ids) // block_size


# -- the masks --------------------------------------------------------------------------------------------------
def causal(doc_ids: torch.Tensor | None = None, key_valid: torch.Tensor | None = None) -> MaskMod:
    """Ordinary causal attention, ``kv <= q``. L = 4::

    q\\k 0 1 2 3
    0    x . . .
    1    x x . .
    2    x x x .
    3    x x x x
    """

    def base(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    return _wrap(base, None, doc_ids, key_valid)


def full(doc_ids: torch.Tensor | None = None, key_valid: torch.Tensor | None = None) -> MaskMod:
    """Full bidirectional attention (MDM sampling/evaluation, annealing finished). L = 3::

    q\\k 0 1 2
    0    x x x
    1    x x x
    2    x x x
    """

    def base(b, h, q_idx, kv_idx):
        return (kv_idx >= 0) & (q_idx >= 0)

    return _wrap(base, None, doc_ids, key_valid)


def draw_anneal(L: int, p: float, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """The Bernoulli(p) ``[L, L]`` draw of annealed attention (one per forward, shared by batch/heads/layers)."""
    if p >= 1.0:
        return torch.ones(L, L, dtype=torch.bool, device=device)
    if p <= 0.0:
        return torch.zeros(L, L, dtype=torch.bool, device=device)
    gen_device = generator.device if generator is not None else torch.device("cpu")
    draw = torch.rand(L, L, generator=generator, device=gen_device) < p
    return draw.to(device) if device is not None else draw


def annealed(
    L: int,
    p: float,
    generator: torch.Generator | None = None,
    doc_ids: torch.Tensor | None = None,
    key_valid: torch.Tensor | None = None,
    draw: torch.Tensor | None = None,
    device=None,
) -> MaskMod:
    """DiffuLLaMA annealed attention: ``allowed(i, j) = (j <= i) OR Bernoulli(p)`` (docs/algorithms.md#annealed-attention).

    One ``[L, L]`` Bernoulli draw per call from ``generator`` (or pass ``draw``), shared by batch, heads and
    layers. ``p = 0`` is causal, ``p = 1`` is full. Example L = 4, p = 0.5 (``o`` = drawn above the diagonal)::

        q\\k 0 1 2 3
        0    x o . o
        1    x x . .
        2    x x x o
        3    x x x x
    """
    if draw is None:
        draw = draw_anneal(L, p, generator, device=device)

    def base(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | draw[q_idx, kv_idx]

    return _wrap(base, None, doc_ids, key_valid)


def block_diffusion(
    L: int, block_size: int, doc_ids: torch.Tensor | None = None, key_valid: torch.Tensor | None = None, device=None
) -> MaskMod:
    """BD3-LM / SDAR training mask over ``[x_t | x0]`` (length 2L, docs/algorithms.md#block-diffusion). L = 4, b = 2 (n = noisy, c = clean)::

           n0 n1 n2 n3 | c0 c1 c2 c3
    n0      x  x  .  . |  .  .  .  .     noisy -> noisy: same block, bidirectional
    n1      x  x  .  . |  .  .  .  .
    n2      .  .  x  x |  x  x  .  .     noisy -> clean: blocks strictly before
    n3      .  .  x  x |  x  x  .  .
    c0      .  .  .  . |  x  x  .  .     clean -> clean: block-causal
    c1      .  .  .  . |  x  x  .  .
    c2      .  .  .  . |  x  x  x  x
    c3      .  .  .  . |  x  x  x  x
    """
    blk = _blocks(L, block_size, doc_ids, device)

    def base(b, h, q_idx, kv_idx):
        bb = b if blk.shape[0] > 1 else b * 0
        q_noisy, k_noisy = q_idx < L, kv_idx < L
        bq, bk = blk[bb, q_idx % L], blk[bb, kv_idx % L]
        nn_ = q_noisy & k_noisy & (bq == bk)
        nc = q_noisy & ~k_noisy & (bk < bq)
        cc = ~q_noisy & ~k_noisy & (bk <= bq)
        return nn_ | nc | cc

    return _wrap(base, L, doc_ids, key_valid)


def introspective(
    L: int, block_size: int = 1, doc_ids: torch.Tensor | None = None, key_valid: torch.Tensor | None = None, device=None
) -> MaskMod:
    """I-DLM training mask over ``[x_t | x0]`` (length 2L, docs/algorithms.md#idlm item 4). L = 4, b = 2::

               n0 n1 n2 n3 | c0 c1 c2 c3
        n0      x  .  .  . |  .  .  .  .     noisy -> noisy: own block, key <= query
        n1      x  x  .  . |  .  .  .  .
        n2      .  .  x  . |  x  x  .  .     noisy -> clean: blocks strictly before
        n3      .  .  x  x |  x  x  .  .
        c0      .  .  .  . |  x  .  .  .     clean -> clean: causal
        c1      .  .  .  . |  x  x  .  .
        c2      .  .  .  . |  x  x  x  .
        c3      .  .  .  . |  x  x  x  x

    Every row is causal in "reading order", so the clean half returns exactly the AR model's logits.
    """
    blk = _blocks(L, block_size, doc_ids, device)

    def base(b, h, q_idx, kv_idx):
        bb = b if blk.shape[0] > 1 else b * 0
        q_noisy, k_noisy = q_idx < L, kv_idx < L
        bq, bk = blk[bb, q_idx % L], blk[bb, kv_idx % L]
        nn_ = q_noisy & k_noisy & (bq == bk) & (kv_idx <= q_idx)
        nc = q_noisy & ~k_noisy & (bk < bq)
        cc = ~q_noisy & ~k_noisy & (kv_idx <= q_idx)
        return nn_ | nc | cc

    return _wrap(base, L, doc_ids, key_valid)


def introspective_cached(
    L: int, block_size: int = 1, doc_ids: torch.Tensor | None = None, key_valid: torch.Tensor | None = None, device=None
) -> MaskMod:
    """The noisy rows of :func:`introspective` with the clean half already in a KV cache: ``L x 2L``.

    Keys are ``[clean cache (L) | noisy (L)]`` (cache first, as transformers appends new keys after the cache);
    queries are the L noisy tokens. Used by the gated-LoRA fast path (docs/algorithms.md#idlm): the clean pass runs once under
    ``no_grad`` and the masks attend to its cache. L = 4, b = 2::

               c0 c1 c2 c3 | n0 n1 n2 n3
        n0      .  .  .  . |  x  .  .  .
        n1      .  .  .  . |  x  x  .  .
        n2      x  x  .  . |  .  .  x  .
        n3      x  x  .  . |  .  .  x  x
    """
    blk = _blocks(L, block_size, doc_ids, device)

    def base(b, h, q_idx, kv_idx):
        bb = b if blk.shape[0] > 1 else b * 0
        k_clean = kv_idx < L
        bq, bk = blk[bb, q_idx % L], blk[bb, kv_idx % L]
        kn = kv_idx - L  # noisy key index
        nn_ = ~k_clean & (bq == bk) & (kn <= q_idx)
        nc = k_clean & (bk < bq)
        return nn_ | nc

    inner = _wrap(base, L, doc_ids, None)
    if key_valid is None:
        return inner
    valid = key_valid.bool()

    def mask_mod(b, h, q_idx, kv_idx):
        # the query's own key sits at L + q in this layout
        return inner(b, h, q_idx, kv_idx) & (valid[b, kv_idx % L] | (kv_idx == q_idx + L))

    return mask_mod


# -- builders ---------------------------------------------------------------------------------------------------
def dense(mask_mod: MaskMod, B: int, Q: int, K: int | None = None, device=None) -> torch.Tensor:
    """Evaluate ``mask_mod`` on the full index grid: bool ``[B, 1, Q, K]`` (True = may attend), for SDPA."""
    K = Q if K is None else K
    b = torch.arange(B, device=device)[:, None, None, None]
    h = torch.zeros(1, dtype=torch.long, device=device)[None, :, None, None]
    q = torch.arange(Q, device=device)[None, None, :, None]
    k = torch.arange(K, device=device)[None, None, None, :]
    out = mask_mod(b, h, q, k)
    return out.expand(B, 1, Q, K).contiguous()


def block_mask(mask_mod: MaskMod, B: int, Q: int, K: int | None = None, device=None, block_size: int = 128):
    """A flex-attention ``BlockMask`` for ``mask_mod`` (used on CUDA; torch's flex attention also runs on CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask

    K = Q if K is None else K
    return create_block_mask(
        mask_mod, B, None, Q, K, device=device if device is not None else "cpu", BLOCK_SIZE=block_size
    )


def build(mask_mod: MaskMod, B: int, Q: int, K: int | None = None, device=None, attn_impl: str | None = None):
    """The mask in the form the model's attention takes: a ``BlockMask`` under transformers' ``flex_attention``
    (which would read a dense boolean tensor as an additive score and mask nothing), else :func:`dense`."""
    if attn_impl == "flex_attention":
        return block_mask(mask_mod, B, Q, K, device=device)
    return dense(mask_mod, B, Q, K, device=device)


def rows_from(mask_mod: MaskMod, L: int, start: int) -> MaskMod:
    """:func:`introspective_cached` with its first ``start`` query rows and noisy key columns dropped.

    Keys become ``[clean cache (L) | noisy start..L-1]`` and queries ``start..L-1``: the I-DLM split path runs the
    noisy pass only from the first block that holds a mask. Equal to slicing the dense ``L x 2L`` mask
    ``[:, :, start:]`` and dropping key columns ``L..L+start-1``, without building them.
    """
    if start == 0:
        return mask_mod

    def shifted(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx + start, torch.where(kv_idx < L, kv_idx, kv_idx + start))

    return shifted


def decode_mask(valid_keys: torch.Tensor, q_len: int, chunk: torch.Tensor | None = None) -> torch.Tensor:
    """Mask for extending a KV cache of ``K_past`` slots by ``q_len`` new tokens: bool ``[B, 1, Q, K_past + Q]``.

    ``valid_keys`` (bool ``[B, K_past]``) says which cache slots of each row hold live tokens (holes left by
    rejected drafts or padding are False). New tokens attend to every valid past slot and causally among
    themselves. K_past = 3 with slot 1 a hole, Q = 2::

        q\\k p0 p1 p2 | n0 n1
        n0   x  .  x  |  x  .
        n1   x  .  x  |  x  x

    ``chunk`` (bool ``[Q, Q]`` or ``[B, Q, Q]``): the new tokens' attention among themselves instead of causal (a
    tree-shaped chunk's)."""
    valid_keys = valid_keys.bool()
    B, K_past = valid_keys.shape
    past = valid_keys[:, None, None, :].expand(B, 1, q_len, K_past)
    if chunk is None:
        new = torch.ones(q_len, q_len, dtype=torch.bool, device=valid_keys.device).tril()
    else:
        new = chunk.to(device=valid_keys.device, dtype=torch.bool)
    new = new.view(-1, 1, q_len, q_len).expand(B, 1, q_len, q_len)
    return torch.cat([past, new], dim=-1)


def render(mask: torch.Tensor, split: int | None = None) -> str:
    """ASCII picture of a 2D bool mask (``x`` allowed, ``.`` blocked); ``split`` draws a ``|`` before that key."""
    rows = []
    for row in mask.bool().tolist():
        cells = ["x" if v else "." for v in row]
        if split is not None:
            cells.insert(split, "|")
        rows.append(" ".join(cells))
    return "\n".join(rows)
