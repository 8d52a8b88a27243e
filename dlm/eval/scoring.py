"""Scoring (context, continuation) pairs with a model: the exact causal log-likelihood and the denoising score.

Both run under ``torch.inference_mode`` in batches bounded by a token budget (rows x padded length), and project
to the vocabulary only the hidden states that are scored (not all ``B x L x V`` logits), so memory stays bounded
whatever the task size. (A reference evaluator keeps 32 forward graphs alive: 8.6 GB for a 135M model.)

- :func:`loglikelihoods` (causal models: AR, I-DLM): ``sum log p(cont_i | ctx, cont_<i)`` under a causal mask,
  plus whether the continuation is the greedy one; context truncated from the left like lm-evaluation-harness.
- :func:`denoising_scores` (bidirectional DLMs, objective mdm/block; docs/algorithms.md#evaluation): the mean over k = T..1 of
  the mean cross-entropy over the continuation tokens masked i.i.d. with probability k/T, under full attention;
  lower is better. The masks of one example are drawn from a generator seeded by (seed, example key), so a score
  is deterministic per example, independent of batching; choices of one example share the uniform draws (common
  random numbers: the same positions are masked where the choices overlap in length), which lowers the variance
  of the comparison. All T masked copies of a pair run in one or a few batched forwards, not one forward per draw.
  Steps at which no token happens to be masked carry no information and are skipped (step T masks every token,
  so every pair has at least one); the reference averaged a NaN there.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dlm.errors import DLMError
from dlm.model import masks
from dlm.model.convert import DiffusionLM, max_positions

DEFAULT_BATCH_TOKENS = 8192  # rows x padded length per forward


# -- the model view --------------------------------------------------------------------------------------------
@dataclass
class EvalModel:
    """What scoring needs from a model: the HF module, its tokenizer and how to score with it.

    ``kind`` is ``"causal"`` (exact AR log-likelihood) or ``"diffusion"`` (denoising score); ``shift``: logits at i
    score token i+1 (always True for causal scoring).
    """

    model: torch.nn.Module  # the Hugging Face causal LM (inside any DiffusionLM/peft wrapper)
    tokenizer: object
    kind: str
    mask_token_id: int | None = None
    shift: bool = True
    objective: str | None = None  # None for a plain AR model
    dlm: object | None = None  # the DiffusionLM, when there is one (the decoding engine wants it)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def max_length(self) -> int:
        return max_positions(self.model.config) or 2048

    @property
    def prefix_token_id(self) -> int:
        """The token put before an empty context (as lm-evaluation-harness does): BOS, else EOS."""
        tok = self.tokenizer
        for tid in (getattr(tok, "bos_token_id", None), getattr(tok, "eos_token_id", None)):
            if tid is not None:
                return int(tid)
        raise DLMError("the tokenizer has neither a BOS nor an EOS token to put before an empty context")


SCORINGS = ("auto", "causal", "diffusion")


def as_eval_model(model, tokenizer=None, scoring: str = "auto") -> EvalModel:
    """Wrap a :class:`~dlm.model.convert.DiffusionLM` or a plain HF causal LM for scoring.

    ``scoring="auto"``: causal log-likelihood for AR models and causal DLMs (I-DLM, ``dlm.is_causal``) and for
    renoising models (DiffusionGemma: its causal encoder's next-token score), the denoising score for bidirectional
    DLMs (mdm, block). ``"causal"`` forces the AR likelihood (any model);
    ``"diffusion"`` forces the denoising score (needs a mask token, i.e. a DLM).
    """
    if isinstance(model, EvalModel):
        return model
    if scoring not in SCORINGS:
        raise DLMError(f"--scoring must be one of {', '.join(SCORINGS)}, got '{scoring}'")

    if isinstance(model, DiffusionLM):
        tok = tokenizer or model.tokenizer
        # a renoising model (DiffusionGemma) has no mask token: its own score is its encoder's next-token one
        kind = "causal" if model.is_causal or model.objective == "renoise" else "diffusion"
        if scoring != "auto":
            kind = scoring
        hf = model.renoise or model.base_model_hf  # a renoising model scores through its wrapper's forward
        em = EvalModel(
            model=hf,
            tokenizer=tok,
            kind=kind,
            mask_token_id=model.mask_token_id,
            shift=True if kind == "causal" else model.shift,
            objective=model.objective,
            dlm=model,
        )
    else:
        tok = tokenizer
        if scoring == "diffusion":
            raise DLMError(
                "--scoring diffusion needs a diffusion LM (with a mask token); this is a plain AR "
                "model: convert it (dlm convert --objective mdm) or use --scoring causal"
            )
        em = EvalModel(model=model, tokenizer=tok, kind="causal", shift=True)
    if em.tokenizer is None:
        raise DLMError("scoring needs the model's tokenizer: pass tokenizer=... (a DiffusionLM carries its own)")
    return em


# -- tokenization ---------------------------------------------------------------------------------------------
def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_pair(em: EvalModel, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of (context, continuation) the way lm-evaluation-harness makes them.

    Trailing whitespace of the context moves to the continuation; the pair is encoded as one string and split
    at the context's length, so a word is never cut differently from how the model saw it in training.
    An empty context becomes the BOS/EOS token.
    """
    n_space = len(context) - len(context.rstrip())
    if n_space:
        continuation = context[-n_space:] + continuation
        context = context[:-n_space]
    if not context:
        return [em.prefix_token_id], encode(em.tokenizer, continuation)
    whole = encode(em.tokenizer, context + continuation)
    ctx = encode(em.tokenizer, context)
    cont = whole[len(ctx) :]
    if not cont:  # the continuation merged into the context's last token: score it on its own
        cont = encode(em.tokenizer, continuation)
    return ctx, cont


def _fit(ctx: list[int], cont: list[int], max_len: int) -> tuple[list[int], int]:
    """Concatenate and cut from the left to ``max_len`` tokens; returns (ids, n_cont kept)."""
    full = ctx + cont
    if len(full) > max_len:
        full = full[-max_len:]
    n_cont = min(len(cont), len(full) - 1)
    if n_cont < 1:
        raise DLMError(f"a continuation of {len(cont)} tokens does not fit the model's {max_len} positions")
    return full, n_cont


# -- forwards -------------------------------------------------------------------------------------------------
def attention_mask(key_valid: torch.Tensor, causal: bool) -> torch.Tensor:
    """``[B, 1, L, L]`` boolean (True = may attend): full or causal, never attending padded keys."""
    B, L = key_valid.shape
    mod = masks.causal(key_valid=key_valid) if causal else masks.full(key_valid=key_valid)
    return masks.dense(mod, B, L, device=key_valid.device)


class _Projector:
    """Runs the backbone once and projects only the selected hidden states to logits.

    Checked once per model against the plain forward (some architectures scale or soft-cap logits); when they
    disagree the full logits are computed instead.
    """

    _checked: dict[int, bool] = {}

    def __init__(self, model):
        self.model = model
        self.backbone = getattr(model, "base_model", None)
        self.head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        key = id(model)
        if key not in self._checked:
            self._checked[key] = self._self_check()
        self.split = self._checked[key]

    def _self_check(self) -> bool:
        if self.backbone is None or self.head is None or self.backbone is self.model:
            return False
        ids = torch.arange(5, device=next(self.model.parameters()).device)[None] % 7 + 1
        with torch.inference_mode():
            want = self.model(input_ids=ids).logits[0]
            h = self.backbone(input_ids=ids).last_hidden_state[0]
            got = self.head(h)
        return got.shape == want.shape and torch.allclose(got.float(), want.float(), atol=1e-4, rtol=1e-4)

    def __call__(self, input_ids, mask4d, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, V]`` (float32) at positions (rows[n], cols[n])."""
        pos = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        if self.split:
            h = self.backbone(input_ids=input_ids, attention_mask=mask4d, position_ids=pos).last_hidden_state
            return self.head(h[rows, cols]).float()
        logits = self.model(input_ids=input_ids, attention_mask=mask4d, position_ids=pos).logits
        return logits[rows, cols].float()


def _batches(lengths: Sequence[int], batch_tokens: int, max_rows: int | None = None):
    """Split indices (already sorted by length, longest first) into batches of rows x max_len <= budget."""
    batch, longest = [], 0
    for i, n in enumerate(lengths):
        new_longest = max(longest, n)
        if batch and (new_longest * (len(batch) + 1) > batch_tokens or (max_rows and len(batch) >= max_rows)):
            yield batch
            batch, new_longest = [], n
        batch.append(i)
        longest = new_longest
    if batch:
        yield batch


def _pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    valid = torch.zeros((len(seqs), L), dtype=torch.bool)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
        valid[r, : len(s)] = True
    return ids.to(device), valid.to(device)


def _suppress_mask(em: EvalModel, logits: torch.Tensor) -> torch.Tensor:
    """The mask token is never a prediction: its logit is -inf, as in decoding. (Conversion adds it to the
    vocabulary; left in the softmax it would take probability mass, and an I-DLM's causal score would no longer
    equal its base AR model's.)"""
    if em.mask_token_id is not None and em.mask_token_id < logits.shape[-1]:
        logits[:, em.mask_token_id] = float("-inf")
    return logits


def _pad_id(em: EvalModel) -> int:
    pid = getattr(em.tokenizer, "pad_token_id", None)
    return int(pid) if pid is not None else em.prefix_token_id


# -- causal log-likelihood --------------------------------------------------------------------------------------
def loglikelihoods(
    em: EvalModel, pairs: Sequence[tuple[list[int], list[int]]], batch_tokens: int = DEFAULT_BATCH_TOKENS, progress=None
) -> list[tuple[float, bool]]:
    """Exact ``(sum log p(continuation | context), is_greedy)`` for each (context ids, continuation ids)."""
    max_len = em.max_length
    items = []
    for ctx, cont in pairs:
        full, n_cont = _fit(list(ctx), list(cont), max_len + 1)
        items.append((full[:-1], full[-n_cont:]))  # model input, scored targets (the last n_cont tokens)
    order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))
    results: list[tuple[float, bool] | None] = [None] * len(items)
    proj = _Projector(em.model)
    with torch.inference_mode():
        for batch in _batches([len(items[i][0]) for i in order], batch_tokens):
            idx = [order[b] for b in batch]
            ids, valid = _pad([items[i][0] for i in idx], _pad_id(em), em.device)
            rows, cols, targets = [], [], []
            for r, i in enumerate(idx):
                inp, tgt = items[i]
                start = len(inp) - len(tgt)  # logit at position p predicts token p+1 of the full sequence
                rows += [r] * len(tgt)
                cols += list(range(start, len(inp)))
                targets += tgt
            rows_t = torch.tensor(rows, device=em.device)
            logits = _suppress_mask(
                em, proj(ids, attention_mask(valid, causal=True), rows_t, torch.tensor(cols, device=em.device))
            )
            logp = torch.log_softmax(logits, dim=-1)
            tgt_t = torch.tensor(targets, device=em.device)
            tok_lp = logp.gather(1, tgt_t[:, None])[:, 0]
            greedy = logp.argmax(-1) == tgt_t
            for r, i in enumerate(idx):
                sel = rows_t == r
                results[i] = (float(tok_lp[sel].double().sum()), bool(greedy[sel].all()))
            if progress is not None:
                progress.update(len(idx))
    return results  # type: ignore[return-value]


# -- denoising score --------------------------------------------------------------------------------------------
def example_seed(seed: int, key) -> int:
    """A stable 63-bit generator seed for (seed, example key); the key may be an int or a string."""
    k = key if isinstance(key, int) else zlib.crc32(str(key).encode())
    return (int(seed) * 1_000_003 + int(k) * 7919 + 12345) % (2**63 - 1)


def draw_masks(n_tokens: int, steps: int, seed: int, key) -> torch.Tensor:
    """``[T, n_tokens]`` bool: row k-1 masks each token with probability k/T (row T-1 masks all).

    The uniforms are drawn token-major from a generator seeded by (seed, key), so two continuations of one
    example share the draws of their common leading positions (common random numbers).
    """
    g = torch.Generator().manual_seed(example_seed(seed, key))
    u = torch.rand(n_tokens, steps, generator=g).T  # [T, n]
    k = torch.arange(1, steps + 1, dtype=torch.float32)[:, None]
    return u < k / steps


def denoising_scores(
    em: EvalModel,
    pairs: Sequence[tuple[list[int], list[int]]],
    keys: Sequence,
    steps: int = 32,
    seed: int = 0,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    progress=None,
) -> list[float]:
    """The denoising score (lower = more likely) of each (context ids, continuation ids); ``keys[i]`` seeds its
    masks (give the choices of one example the same key)."""
    if em.mask_token_id is None:
        raise DLMError("the denoising score needs a mask token: evaluate a DLM (dlm convert) or use --scoring causal")
    if steps < 1:
        raise DLMError(f"--diffusion-steps must be >= 1, got {steps}")
    max_len = em.max_length
    # rows: one per (pair, step with >= 1 masked token)
    row_ids: list[list[int]] = []
    row_pos: list[list[int]] = []  # masked positions in the full sequence
    row_pair: list[int] = []
    fulls: list[list[int]] = []
    for i, (ctx, cont) in enumerate(pairs):
        full, n_cont = _fit(list(ctx), list(cont), max_len)
        fulls.append(full)
        masks = draw_masks(len(cont), steps, seed, keys[i])[:, len(cont) - n_cont :]  # [T, n_cont]
        base = len(full) - n_cont
        for k in range(steps):
            where = masks[k].nonzero()[:, 0].tolist()
            if not where:
                continue
            x = list(full)
            for j in where:
                x[base + j] = em.mask_token_id
            row_ids.append(x)
            row_pos.append([base + j for j in where])
            row_pair.append(i)
    sums = torch.zeros(len(pairs), dtype=torch.float64)
    counts = torch.zeros(len(pairs), dtype=torch.float64)
    order = sorted(range(len(row_ids)), key=lambda r: -len(row_ids[r]))
    proj = _Projector(em.model)
    offset = 1 if em.shift else 0  # with shift, the logit at i scores token i+1
    with torch.inference_mode():
        for batch in _batches([len(row_ids[r]) for r in order], batch_tokens):
            idx = [order[b] for b in batch]
            ids, valid = _pad([row_ids[r] for r in idx], _pad_id(em), em.device)
            rows, cols, targets, owner = [], [], [], []
            for b, r in enumerate(idx):
                full = fulls[row_pair[r]]
                for p in row_pos[r]:
                    rows.append(b)
                    cols.append(p - offset)
                    targets.append(full[p])
                owner.append(len(row_pos[r]))
            logits = _suppress_mask(
                em,
                proj(
                    ids,
                    attention_mask(valid, causal=False),
                    torch.tensor(rows, device=em.device),
                    torch.tensor(cols, device=em.device),
                ),
            )
            ce = F.cross_entropy(logits, torch.tensor(targets, device=em.device), reduction="none").double().cpu()
            start = 0
            for b, r in enumerate(idx):
                n = owner[b]
                sums[row_pair[r]] += ce[start : start + n].mean()
                counts[row_pair[r]] += 1
                start += n
            if progress is not None:
                progress.update(len(idx))
    if (counts == 0).any():  # cannot happen: step T masks every token
        raise AssertionError("a pair got no masked step")
    return (sums / counts).tolist()


def stderr_of_mean(values: Sequence[float]) -> float:
    """Sample standard error of the mean (n-1 in the variance), as lm-evaluation-harness reports."""
    n = len(values)
    if n < 2:
        return float("nan")
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return math.sqrt(var / n)
