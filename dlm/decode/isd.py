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

When to draft: ``token_budget`` picks a policy of :mod:`dlm.decode.schedule` (always; while rows x (2N-1) <= T;
``'auto'``: whichever of drafting and plain AR steps measures faster at the current batch size). A step the
policy runs without drafts feeds ``[pending token]`` per row: an AR step, exact like everything else here.

Exactness: with drafts *sampled* from q (the default) the output has exactly the model's causal distribution p
after temperature/top-k/top-p (the same transform is applied to p and q, once). ``draft="argmax"`` is the
reference's choice (higher acceptance) and is biased towards the argmax when sampling; it is an explicit,
approximate option. Greedy decoding is exact either way.
"""

from __future__ import annotations

import torch

from dlm.decode import check_candidates, check_fallback
from dlm.decode.engine import Decoder, Engine, Row, warn
from dlm.decode.sampling import probs_from_logits, sample, suppress
from dlm.decode.schedule import make_policy
from dlm.errors import DLMError

DRAFT_MODES = ("sample", "argmax")
# Draft candidates beyond the first are verified only where the mask gives them at least this probability: each
# costs two chunk tokens, and a 2% candidate is rarely the one. Measured on the gated 30-minute quickstart
# checkpoint (609 verify steps of 16 held-out prompts, greedy, batch 1; per-forward costs of 4/6/8-token chunks
# 1.22x/1.28x/1.38x an AR step on a 2-core CPU): speed vs AR 1.14x for K=3 always (TPF 1.58), 1.16x / 1.18x / 1.16x
# with a 0.05 / 0.1 / 0.2 threshold (TPF 1.55 / 1.48 / 1.41). 0.05 keeps most of the TPF, which is what a device
# with cheaper chunk tokens (a GPU) turns into speed; 0 verifies all K every step.
CANDIDATE_MIN_PROB = 0.05


def supported_strides(block_size: int | None) -> list[int]:
    """Strides an I-DLM trained with ``block_size`` masks per block was trained for: 2..block_size+1 (a shorter
    run of masks is a prefix of a trained block)."""
    return list(range(2, (block_size or 1) + 2))


def default_stride(block_size: int | None, candidates: int = 1) -> int:
    """The stride ISD runs at when none is given: the model's trained ``block_size + 1``, or 2 with draft
    candidates (they run at stride 2 only)."""
    return 2 if candidates > 1 else (block_size or 1) + 1


class ISDDecoder(Decoder):
    name = "isd"

    def __init__(
        self,
        stride: int | None = None,
        draft: str = "sample",
        token_budget: int | str | None = None,
        fallback: str = "predict",
        candidates: int = 1,
        candidate_min_prob: float = CANDIDATE_MIN_PROB,
    ):
        if draft not in DRAFT_MODES:
            raise DLMError(f"unknown ISD draft mode '{draft}': use 'sample' (exact) or 'argmax' (approximate)")
        if stride is not None and (not isinstance(stride, int) or stride < 2):
            raise DLMError(f"--stride must be an integer >= 2 (N-1 drafts per step), got {stride}")
        self.stride = stride
        self.draft = draft
        self.token_budget = token_budget
        check_fallback(fallback)
        self.fallback = fallback
        check_candidates(candidates, stride)
        self.candidates = candidates
        if (
            isinstance(candidate_min_prob, bool)
            or not isinstance(candidate_min_prob, (int, float))
            or not 0.0 <= candidate_min_prob <= 1.0
        ):
            raise DLMError(f"candidate_min_prob must be a probability in [0, 1], got {candidate_min_prob!r}")
        self.candidate_min_prob = float(candidate_min_prob)
        self._layouts: dict[tuple, tuple[list[int], torch.Tensor]] = {}
        self.branch_steps = {"verify": 0, "predicted": 0}  # verify steps; those whose outcome had its drafts
        self._calib = AcceptCalibration()
        if token_budget is not None:  # refuse a bad value at construction, before the model is checked
            make_policy(token_budget, stride or 2)
        self.policy = None  # set in check_model, once the stride is known
        self._drafting = True  # this step's choice (plan_step)
        self.mode_steps = {"draft": 0, "ar": 0}  # decode steps by the policy's choice (for /metrics)

    def check_model(self, engine: Engine) -> None:
        spec = engine.spec
        if spec is None or engine.mask_token_id is None:
            raise DLMError(
                "--decode isd needs an I-DLM (a model with a mask token and dlm_objective 'idlm'); "
                "convert it first (dlm convert --objective idlm) or let `dlm generate` convert a plain "
                "AR model on the fly"
            )
        if spec.objective != "idlm":
            raise DLMError(
                f"--decode isd needs a causal I-DLM (objective 'idlm'), but this is a "
                f"'{spec.objective}' model with {'bidirectional' if spec.objective == 'mdm' else 'block'}"
                f" attention; use --decode {'mdm' if spec.objective == 'mdm' else 'block'}"
            )
        if not spec.shift:
            raise DLMError(
                "--decode isd needs the I-DLM shift (shift=true in config.json): a mask predicts the "
                "token after its position"
            )
        if self.stride is None:
            self.stride = default_stride(spec.block_size, self.candidates)
        ok = supported_strides(spec.block_size)
        if self.stride not in ok:
            warn(
                f"--stride {self.stride}: this model was trained with block_size={spec.block_size}, i.e. for "
                f"strides {', '.join(map(str, ok))}; larger strides run (output stays exact) but drafts beyond "
                f"the trained block are poor"
            )
        self.policy = make_policy(self.token_budget, self.stride, self.verify_len)

    # -- when to draft (dlm.decode.schedule) -------------------------------------------------------------------
    def plan_step(self, engine: Engine, rows: list[Row]) -> None:
        self._drafting = self.policy.drafting(len(rows))
        self.mode_steps["draft" if self._drafting else "ar"] += 1

    def step_done(self, engine: Engine, rows: list[Row], seconds: float, tokens: int) -> None:
        self.policy.observe(len(rows), self._drafting, seconds, tokens)

    # -- chunks -------------------------------------------------------------------------------------------
    @property
    def verify_len(self) -> int:
        """Tokens a row feeds in a verify step: 2N-1 (one branch of masks), N-1 + N x (N-1) with every branch;
        with K draft candidates 2K+1, plus the rejection branch's mask unless fallback is off."""
        n = self.stride or 2
        if self.candidates > 1:
            return 1 + 2 * self.candidates + (self.fallback != "off")
        return n + (n - 1) * (n if self.fallback == "all" else 1)

    def _branches(self, row: Row) -> tuple[int, ...]:
        """Which outcomes of this verify step get their N-1 masks (0: every draft accepted; i: first rejection at
        d_i). ``predict``: the likeliest outcome by the drafts' acceptance probabilities a_i, i.e.
        P(0) = prod a_i, P(i) = a_1 .. a_{i-1} (1 - a_i), where a_i is the draft's own probability q_i(d_i)
        calibrated by the acceptance measured so far for drafts of that probability (:class:`AcceptCalibration`)."""
        n = self.stride
        if self.fallback == "off":
            return (0,)
        if self.fallback == "all":
            return tuple(range(n))
        conf = row.state.get("conf") or [1.0] * (n - 1)
        best, p_best, run = 0, 0.0, 1.0
        for i, c in enumerate((self._calib.p_accept(i, c) for i, c in enumerate(conf)), start=1):
            if run * (1.0 - c) > p_best:
                best, p_best = i, run * (1.0 - c)
            run *= c
        return (0,) if run >= p_best else (best,)

    def chunk_layout(self, engine: Engine, row: Row, n: int):
        branches = row.state.get("branches")
        if not branches or branches == (0,):  # a cold, AR or plain verify chunk: a sequence
            return None
        key = (self.stride, branches)
        if key not in self._layouts:
            self._layouts[key] = (
                candidate_layout(*branches[1:]) if branches[0] == "cands" else branch_layout(self.stride, branches)
            )
        return self._layouts[key]

    def _room(self, engine: Engine, row: Row) -> bool:
        return row.pos + 2 * self.stride - 1 <= engine.max_positions

    def prefill_suffix(self, engine: Engine, row: Row) -> list[int]:
        row.state.update(mode="cold", drafts=None, q=None)
        n = self.stride
        if len(row.prompt_ids) + n - 1 > engine.max_positions:
            return []
        if not self.policy.peek(len(engine.rows) + 1):  # the joining row counts itself
            return []
        return [engine.mask_token_id] * (n - 1)

    def chunk(self, engine: Engine, row: Row) -> list[int]:
        n = self.stride
        row.state["branches"] = None
        if not self._drafting or not self._room(engine, row):
            # the policy says drafting does not pay now, or near the end of the context: a plain AR step (exact)
            row.state.update(mode="ar", drafts=None, q=None)
            return [row.last]
        m = engine.mask_token_id
        if row.state["mode"] == "verify" and self.candidates > 1:
            k, fb = len(row.state["cands"]), self.fallback != "off"
            row.state["branches"] = ("cands", k, fb)
            return [row.last] + row.state["cands"] + [m] * (k + fb)
        if row.state["mode"] == "verify":
            branches = self._branches(row)
            row.state["branches"] = branches
            return [row.last] + row.state["drafts"] + [m] * ((n - 1) * len(branches))
        row.state["mode"] = "cold"
        return [row.last] + [m] * (n - 1)

    # -- sampling helpers ---------------------------------------------------------------------------------
    def _draft(self, engine: Engine, row: Row, mask_logits: torch.Tensor, first_pos: int) -> None:
        """Drafts d_1..d_{N-1} (and their q) from the N-1 mask logits [N-1, V]; d_1 sits at ``first_pos``."""
        p = row.params
        k = self.candidates
        if p.greedy:
            q = None
            logits = suppress(mask_logits, engine.mask_token_id)
            d = logits.argmax(-1)
            if k > 1:  # (never the suppressed mask token, even when K reaches the vocabulary's size)
                top = logits[0].topk(min(k, logits.shape[-1] - 1))
                k = self._candidate_count((top.values.float() - logits[0].float().logsumexp(-1)).exp())
                row.state["cands"] = top.indices[:k].tolist()
        else:
            q = probs_from_logits(mask_logits, p, engine.mask_token_id)
            d = q.argmax(-1) if self.draft == "argmax" else sample(q, row.generator)
            if k > 1:  # draws without replacement (_consume_candidates verifies them exactly); argmax: top k
                # how many: from q alone, before any draw (a count that depended on the draws would bias them)
                top = q[0].topk(min(k, q.shape[-1]))
                k = self._candidate_count(top.values)
                row.state["cands"] = (
                    top.indices[:k].tolist()
                    if self.draft == "argmax"
                    else draws_without_replacement(q[0], int(d[0]), k, row.generator)
                )
        row.state["drafts"] = d.tolist()
        row.state["q"] = q
        if self.fallback == "predict" and k == 1:  # each draft's probability under its own distribution
            probs = q if q is not None else logits.float().softmax(-1)
            row.state["conf"] = probs.gather(-1, d[:, None])[:, 0].tolist()

    def _candidate_count(self, top_probs: torch.Tensor) -> int:
        """How many candidates this step verifies: 1 + those of the 2nd..K-th likeliest drafts (``top_probs``,
        descending) with probability >= ``candidate_min_prob``."""
        return 1 + int((top_probs[1:] >= self.candidate_min_prob).sum())

    def _verified(self, row: Row, proposed: int, accepted: int) -> None:
        """A verify step checked ``proposed`` drafts and accepted ``accepted``: per-request statistics, and what
        ``predict`` learns about how often a draft of a given probability is accepted."""
        conf = row.state.get("conf")
        if self.fallback == "predict" and conf:
            for i in range(proposed):
                self._calib.observe(i, conf[i], i < accepted)
        s = row.stats
        if not s.proposed:
            s.proposed = [0] * (self.stride - 1)
            s.accepted = [0] * (self.stride - 1)
        for i in range(proposed):
            s.proposed[i] += 1
        for i in range(accepted):
            s.accepted[i] += 1

    def _next_drafts(self, engine: Engine, row: Row, logits: torch.Tensor, outcome: int) -> None:
        """After a verify step whose outcome is ``outcome`` (0: all accepted, i: first rejection at d_i): if the
        chunk carried that outcome's masks (they saw c and the accepted drafts and stand in for the next token's
        position and after), their logits give the next drafts and the next step verifies again; otherwise the
        next step cold-starts."""
        n = self.stride
        branches = row.state.get("branches") or (0,)
        self.branch_steps["verify"] += 1
        if outcome in branches:
            self.branch_steps["predicted"] += 1
            first = n + branches.index(outcome) * (n - 1)
            first_pos = row.pos + (outcome + 1 if outcome else n + 1)  # where the next d_1 will sit
            self._draft(engine, row, logits[first : first + n - 1], first_pos)
            row.state["mode"] = "verify"
        else:
            row.state.update(mode="cold", drafts=None, q=None)

    # -- consume ------------------------------------------------------------------------------------------
    def consume(self, engine: Engine, row: Row, logits: torch.Tensor) -> tuple[list[int], int]:
        n = self.stride
        p = row.params
        mode = row.state["mode"]
        if mode == "ar" or row.state.pop("no_room", False) or logits.shape[0] == 1:
            probs_or_logits = logits[0]
            tok = (
                int(suppress(probs_or_logits, engine.mask_token_id).argmax())
                if p.greedy
                else int(sample(probs_from_logits(probs_or_logits, p, engine.mask_token_id), row.generator))
            )
            row.last = tok
            row.state.update(mode="cold", drafts=None, q=None)
            return [tok], 1

        if mode == "cold":
            # logits[0] at t0 -> c; logits[1 .. N-1] at masks p+1..p+N-1 -> drafts for p+2..p+N
            first = logits[0]
            c = (
                int(suppress(first, engine.mask_token_id).argmax())
                if p.greedy
                else int(sample(probs_from_logits(first, p, engine.mask_token_id), row.generator))
            )
            self._draft(engine, row, logits[1:n], row.pos + 2)
            row.last = c
            row.state["mode"] = "verify"
            return [c], 1

        if self.candidates > 1:
            return self._consume_candidates(engine, row, logits)

        # verify: logits[i-1] is p_i for d_i (i = 1..N-1), logits[N-1] gives the free token,
        # logits[N .. 2N-2] (the masks) give the next drafts
        drafts = row.state["drafts"]
        if p.greedy:
            target = suppress(logits[:n], engine.mask_token_id).argmax(-1).tolist()
            accepted = 0
            while accepted < n - 1 and drafts[accepted] == target[accepted]:
                accepted += 1
            if accepted == n - 1:
                free = target[n - 1]
                self._verified(row, n - 1, n - 1)
                self._next_drafts(engine, row, logits, 0)
                row.last = free
                return drafts + [free], n
            correction = target[accepted]
            self._verified(row, accepted + 1, accepted)
            row.last = correction
            self._next_drafts(engine, row, logits, accepted + 1)
            return drafts[:accepted] + [correction], accepted + 1

        q = row.state["q"]  # [N-1, V]
        probs = probs_from_logits(logits[:n], p, engine.mask_token_id)  # [N, V]
        u = torch.rand(n - 1, generator=row.generator)
        accepted = 0
        for i in range(n - 1):
            correction = accept_or_correct(probs[i], q[i], drafts[i], float(u[i]), row.generator)
            if correction is None:
                accepted += 1
                continue
            self._verified(row, accepted + 1, accepted)
            row.last = correction
            self._next_drafts(engine, row, logits, accepted + 1)
            return drafts[:accepted] + [correction], accepted + 1
        free = int(sample(probs[n - 1], row.generator))
        self._verified(row, n - 1, n - 1)
        self._next_drafts(engine, row, logits, 0)
        row.last = free
        return drafts + [free], n

    def _consume_candidates(self, engine: Engine, row: Row, logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """A candidate verify step (stride 2): logits[0] at c is p for the next token, logits[j] at d^j the
        distribution after it, logits[K + j] at M^j the next draft after d^j, logits[2K + 1] at F (if fed) the next
        draft after a rejection. Sampling: :func:`recursive_rejection`."""
        p = row.params
        cands = row.state["cands"]
        k = len(cands)
        m = engine.mask_token_id
        if p.greedy:
            target = int(suppress(logits[0], m).argmax())
            hit = cands.index(target) if target in cands else None
            token = target
        else:
            hit, token = recursive_rejection(
                probs_from_logits(logits[0], p, m), row.state["q"][0], cands, row.generator
            )
        self.branch_steps["verify"] += 1
        if hit is not None:
            self._verified(row, 1, 1)
            after = logits[1 + hit]
            free = (
                int(suppress(after, m).argmax())
                if p.greedy
                else int(sample(probs_from_logits(after, p, m), row.generator))
            )
            self.branch_steps["predicted"] += 1
            self._draft(engine, row, logits[1 + k + hit : 2 + k + hit], row.pos + 3)
            row.state["mode"] = "verify"
            row.last = free
            return [token, free], [0, 1 + hit]
        self._verified(row, 1, 0)
        row.last = token
        if logits.shape[0] > 1 + 2 * k:  # F: the masks of the rejection branch
            self.branch_steps["predicted"] += 1
            self._draft(engine, row, logits[1 + 2 * k : 2 + 2 * k], row.pos + 2)
            row.state["mode"] = "verify"
        else:
            row.state.update(mode="cold", drafts=None, q=None)
        return [token], [0]


def accept_or_correct(p: torch.Tensor, q: torch.Tensor, d: int, u: float, generator) -> int | None:
    """The single-draft rule (speculative sampling): draft ``d`` drawn from ``q`` [V] is accepted with probability
    min(1, p(d)/q(d)) for the uniform draw ``u`` (None: accepted); on a rejection the correction is drawn from
    normalize(max(0, p - q)). The token emitted (d or the correction) has distribution exactly ``p``."""
    if u * float(q[d]) < float(p[d]):  # q(d) > 0 because d was drawn from q
        return None
    residual = (p - q).clamp_(min=0.0)
    total = float(residual.sum())
    # total == 0 only if p == q, where rejection has probability 0; guard against rounding anyway
    dist = residual / total if total > 0 else p
    return int(sample(dist, generator))


def draws_without_replacement(q: torch.Tensor, first: int, k: int, generator) -> list[int]:
    """``first`` (already drawn from q), then up to k-1 more from q without replacement (fewer if q has fewer
    tokens with mass, e.g. after top-k/top-p)."""
    rest = q.clone()
    out = [first]
    for _ in range(k - 1):
        rest[out[-1]] = 0.0
        total = float(rest.sum())
        if total <= 0:
            break
        out.append(int(sample(rest / total, generator)))
    return out


def recursive_rejection(p: torch.Tensor, q: torch.Tensor, cands: list[int], generator) -> tuple[int | None, int]:
    """One token with distribution exactly ``p`` [V] from candidates drawn from ``q`` [V] without replacement
    (``cands[j]`` from q_j: q with the earlier candidates removed and renormalised): recursive rejection sampling
    (Jeon et al. 2024, the without-replacement form of SpecInfer's multi-draft sampling). Candidate j is accepted
    with probability min(1, r_j(d^j) / q_j(d^j)), where r_1 = p and a rejection leaves r_{j+1} =
    normalize(max(0, r_j - q_j)); if every candidate is rejected the token is drawn from the last residual. Each
    step is the single-draft rule with target r_j and proposal q_j, whatever the earlier draws were, so the token
    has distribution p. Returns (index of the accepted candidate or None, token)."""
    rest = q.clone()  # q without the candidates before j (unnormalised)
    r = p
    u = torch.rand(len(cands), generator=generator)
    for j, d in enumerate(cands):
        qj = rest / rest.sum()
        if float(u[j]) * float(qj[d]) < float(r[d]):
            return j, d
        r = (r - qj).clamp_(min=0.0)
        total = float(r.sum())
        # total == 0 only if r == q_j, where rejection has probability 0; guard against rounding anyway
        r = r / total if total > 0 else p
        rest[d] = 0.0
    return None, int(sample(r, generator))


def candidate_layout(k: int, fallback: bool) -> tuple[list[int], torch.Tensor]:
    """Offsets and attention of a candidate verify chunk ``[c, d^1..d^k, M^1..M^k (, F)]``: c at offset 0; each
    candidate at offset 1 sees c; M^j at offset 2 sees c and d^j; F (the rejection branch) at offset 1 sees c. Every
    token sees itself. k = 2 with F::

        token  off  sees  c d1 d2 M1 M2 F
        c       0         x
        d1      1         x x
        d2      1         x .  x
        M1      2         x x  .  x
        M2      2         x .  x  .  x
        F       1         x .  .  .  .  x
    """
    total = 1 + 2 * k + bool(fallback)
    offsets = [0] + [1] * k + [2] * k + [1] * bool(fallback)
    attn = torch.eye(total, dtype=torch.bool)
    attn[:, 0] = True
    for j in range(k):
        attn[1 + k + j, 1 + j] = True
    return offsets, attn


class AcceptCalibration:
    """How often a draft at position i with probability c under its own distribution is accepted, learned from the
    verify steps so far: per position and tenth of c, hits and trials (halved past ``cap`` trials, so it follows
    drift), with c itself as a prior worth ``prior`` trials. A model's drafts need not be calibrated (a masked
    position trained on hard labels may be right at c = 0.2 every time); the counts correct that within a few
    steps."""

    def __init__(self, bins: int = 10, prior: float = 2.0, cap: int = 256):
        self.bins, self.prior, self.cap = bins, prior, cap
        self.counts: dict[tuple[int, int], list[float]] = {}

    def _bin(self, c: float) -> int:
        return min(max(int(c * self.bins), 0), self.bins - 1)

    def p_accept(self, i: int, c: float) -> float:
        hits, n = self.counts.get((i, self._bin(c)), (0.0, 0.0))
        return (hits + self.prior * c) / (n + self.prior)

    def observe(self, i: int, c: float, accepted: bool) -> None:
        cell = self.counts.setdefault((i, self._bin(c)), [0.0, 0.0])
        cell[0] += accepted
        cell[1] += 1
        if cell[1] > self.cap:
            cell[0] /= 2
            cell[1] /= 2


def branch_layout(n: int, branches: tuple[int, ...]) -> tuple[list[int], torch.Tensor]:
    """Offsets and attention of a verify chunk at stride ``n`` that carries the masks of ``branches``:
    ``[c, d_1..d_{N-1}]`` (offsets 0..N-1, causal), then N-1 masks per branch. Branch 0 (every draft accepted)
    sits at offsets N..2N-2 and sees the whole chunk before it: the plain verify chunk. Branch i (first rejection
    at d_i) sits at offsets i..i+N-2 and sees c, d_1..d_{i-1} and its own earlier masks: what a cold start from
    the correction at offset i would feed, minus the correction itself. N = 2, branches (0, 1)::

        token  off  sees      c d1 M  F
        c       0             x .  .  .
        d1      1             x x  .  .
        M       2             x x  x  .
        F       1   (d1 rej.) x .  .  x
    """
    total = n + (n - 1) * len(branches)
    offsets = list(range(n))
    attn = torch.zeros(total, total, dtype=torch.bool)
    attn[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril_()
    own = torch.ones(n - 1, n - 1, dtype=torch.bool).tril_()
    for k, b in enumerate(branches):
        lo = n + k * (n - 1)
        start = b if b else n
        offsets += list(range(start, start + n - 1))
        attn[lo : lo + n - 1, : (b if b else n)] = True  # c, d_1 .. d_{b-1} (all of them for branch 0)
        attn[lo : lo + n - 1, lo : lo + n - 1] = own
    return offsets, attn
