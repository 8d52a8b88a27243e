"""Introspective Strided Decoding (ISD, docs/algorithms.md#isd) on the engine.

Stride N. With the I-DLM shift a mask stands in for the token at its own position and predicts the next one.

- Cold start (prefill, or after a rejection): chunk ``[t0, M x (N-1)]`` at positions p..p+N-1 (N tokens, not the
  2N-1 of a verify chunk: at batch 1 every token of a forward costs - LoRA rows, wider matmuls - and in a batch the
  engine pads the shorter chunks anyway; nobody attends to pads). The logit at t0 gives the next token
  ``c`` (drawn as the AR model would); the masks at p+1..p+N-1 give drafts d_1..d_{N-1} for positions
  p+2..p+N with their distributions q. Only t0's KV is kept. One token per forward.
- Verify: chunk ``[c, d_1..d_{N-1}, M x (N-1)]`` at p..p+2N-2. The logit at c is p_1 (the AR distribution of
  d_1), the logit at d_i is p_{i+1}. Drafts are checked left to right: accept d_i with probability
  ``min(1, p_i(d_i) / q_i(d_i))`` (greedy: iff d_i = argmax p_i). On the first rejection the correction is drawn
  from ``normalize(max(0, p_i - q_i))`` (greedy: argmax p_i), the KV of c and the accepted drafts is kept and
  everything after (rejected drafts, masks) becomes a hole; the next step cold-starts from the correction.
  If all N-1 are accepted, the logit at d_{N-1} gives a free token (drawn from p) and the masks at p+N..p+2N-2
  give the next drafts: N tokens from one forward. Mask KV never stays in the cache.
- Fallback drafts (``fallback``, ours): the verify chunk above carries the masks of one outcome only (all
  accepted), so a rejection costs a cold-start step. Each outcome "first rejection at d_i" has its own N-1
  masks at offsets i..i+N-2 that see c, d_1..d_{i-1} (a tree chunk, :func:`branch_layout`); after that
  rejection their logits are the next drafts and the next step verifies again. ``'predict'`` (default) carries
  the masks of the likeliest outcome only (chunk length 2N-1 either way), ``'all'`` of every outcome
  (N-1 + N(N-1) tokens), ``'off'`` of all-accepted only (plain ISD). Drafts are proposals: exact in every mode.
- Draft candidates (``candidates`` K > 1, stride 2; ours, SpecInfer-style token tree): the mask gives K drafts for
  the next position instead of one (greedy: its top K; sampling: K draws from q without replacement), each with its
  own mask for the draft after it: chunk ``[c, d^1..d^K, M^1..M^K]`` at offsets 0, 1 x K, 2 x K (d^j sees c; M^j
  sees c and d^j), plus the rejection branch's mask F (offset 1, sees c) unless ``fallback='off'``. The step accepts
  the candidate equal to the AR token (greedy) or runs recursive rejection sampling over candidates drawn from q
  without replacement (accept d^j with probability min(1, r(d^j) / q_j(d^j)), q_j = q without the earlier
  candidates, r the residual they left, initially p; SpecInfer's multi-draft sampling in the form of Jeon et al.
  2024; exact). Accepted: 2 tokens, KV of c and d^j kept, the next drafts from M^j; rejected: the correction, the
  next drafts from F. Acceptance becomes the top-K coverage of the mask's distribution for 2K-1 more tokens per
  forward (free where the device is latency-bound). Up to K: the 2nd..K-th are verified only where the mask gives
  them at least ``candidate_min_prob`` (:data:`CANDIDATE_MIN_PROB`), a count taken from q before any draw.

When to draft: ``draft_budget`` picks a policy of :mod:`dlm.decode.schedule` (always; while rows x (2N-1) <= T;
``'auto'``: whichever of drafting and plain AR steps measures faster at the current batch size). A step the
policy runs without drafts feeds ``[pending token]`` per row: an AR step, exact like everything else here.

Exactness: with drafts *sampled* from q (the default) the output has exactly the model's causal distribution p
after temperature/top-k/top-p (the same transform is applied to p and q, once). ``draft="argmax"`` is the
reference's choice (higher acceptance) and is biased towards the argmax when sampling; it is an explicit,
approximate option. Greedy decoding is exact either way.

The package, by concern:

- :mod:`~dlm.decode.isd.decoder`: :class:`ISDDecoder`, the engine's Decoder protocol (chunks in, tokens out);
- :mod:`~dlm.decode.isd.state`: :class:`ISDRowState`, one row's state between steps (the decoder's own);
- :mod:`~dlm.decode.isd.accept`: the acceptance rules (single drafts, candidates, the fallback choice), pure;
- :mod:`~dlm.decode.isd.draft`: the proposer (drafts, their q, candidates) from the masks' logits, pure;
- :mod:`~dlm.decode.isd.tree`: tree chunks' offsets and attention (fallback branches, candidates), pure;
- :mod:`~dlm.decode.isd.policy`: the stride, when to draft (:mod:`dlm.decode.schedule`), how many candidates,
  and the acceptance calibration ``predict`` routes on;
- :mod:`~dlm.decode.isd.stats`: per-request acceptance counts and the decoder's step counters.
"""

from dlm.decode.isd.accept import (
    accept_or_correct,
    draws_without_replacement,
    fallback_branches,
    greedy_candidate,
    recursive_rejection,
    verify_greedy,
    verify_sampled,
)
from dlm.decode.isd.decoder import ISDDecoder, state_of
from dlm.decode.isd.draft import Proposal, propose
from dlm.decode.isd.policy import (
    CANDIDATE_MIN_PROB,
    DRAFT_MODES,
    AcceptCalibration,
    DraftPolicy,
    candidate_count,
    default_stride,
    supported_strides,
)
from dlm.decode.isd.state import ISDRowState
from dlm.decode.isd.stats import StepCounts, record_verify
from dlm.decode.isd.tree import Layout, LayoutCache, branch_layout, branch_masks, candidate_layout, verify_len

__all__ = [
    "CANDIDATE_MIN_PROB",
    "DRAFT_MODES",
    "AcceptCalibration",
    "DraftPolicy",
    "ISDDecoder",
    "ISDRowState",
    "Layout",
    "LayoutCache",
    "Proposal",
    "StepCounts",
    "accept_or_correct",
    "branch_layout",
    "branch_masks",
    "candidate_count",
    "candidate_layout",
    "default_stride",
    "draws_without_replacement",
    "fallback_branches",
    "greedy_candidate",
    "propose",
    "record_verify",
    "recursive_rejection",
    "state_of",
    "supported_strides",
    "verify_greedy",
    "verify_len",
    "verify_sampled",
]
