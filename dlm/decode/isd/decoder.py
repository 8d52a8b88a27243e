"""The ISD decoder on the engine (the algorithm: :mod:`dlm.decode.isd`, docs/algorithms.md#isd): the Decoder
protocol's methods, each building a chunk or reading logits through the pure parts (:mod:`~dlm.decode.isd.draft`,
:mod:`~dlm.decode.isd.accept`, :mod:`~dlm.decode.isd.tree`, :mod:`~dlm.decode.isd.policy`) and keeping the row's
:class:`~dlm.decode.isd.state.ISDRowState`."""

from __future__ import annotations

import warnings

import torch

from dlm.decode.configs import ISDConfig
from dlm.decode.engine import Decoder, Engine, Keep, Row, warn
from dlm.decode.isd import accept, policy
from dlm.decode.isd.draft import propose
from dlm.decode.isd.state import ISDRowState
from dlm.decode.isd.stats import StepCounts, record_verify
from dlm.decode.isd.tree import Layout, LayoutCache, branch_masks, verify_len
from dlm.decode.sampling import next_token, probs_from_logits, sample, suppress
from dlm.errors import DLMError


def state_of(row: Row) -> ISDRowState:
    """The row's ISD state (created at its first use: the prefill)."""
    st = row.state
    if not isinstance(st, ISDRowState):
        st = row.state = ISDRowState()
    return st


class ISDDecoder(Decoder):
    """``stride`` N (None: the model's ``block_size + 1``); ``draft``: 'sample' (exact) or 'argmax'
    (approximate); ``draft_budget``: when a step drafts (:func:`dlm.decode.schedule.make_policy`: None / 'always',
    an int, 'auto' or a policy object; ``token_budget`` is its old name, accepted with a DeprecationWarning);
    ``fallback``: which outcomes get masks for the next drafts ('predict' | 'all' | 'off'); ``candidates`` K:
    draft candidates per position (stride 2), the 2nd..K-th verified where the mask gives them at least
    ``candidate_min_prob``."""

    name = "isd"

    def __init__(
        self,
        stride: int | None = None,
        draft: str = "sample",
        draft_budget: int | str | policy.DraftPolicy | None = None,
        fallback: str = "predict",
        candidates: int = 1,
        candidate_min_prob: float = policy.CANDIDATE_MIN_PROB,
        token_budget: int | str | policy.DraftPolicy | None = None,
    ):
        if token_budget is not None:
            warnings.warn(
                "ISDDecoder(token_budget=...) is deprecated: use draft_budget=... (the same drafting policy)",
                DeprecationWarning,
                stacklevel=2,
            )
            if draft_budget is not None:
                raise DLMError("give ISDDecoder draft_budget or its old name token_budget, not both")
            draft_budget = token_budget
        # the checks of the settings, written once (dlm.decode.configs)
        ISDConfig(
            stride=stride,
            draft=draft,
            draft_budget=draft_budget,
            fallback=fallback,
            candidates=candidates,
            candidate_min_prob=candidate_min_prob,
        )
        self.stride = stride
        self.draft = draft
        self.draft_budget = draft_budget
        self.fallback = fallback
        self.candidates = candidates
        self.candidate_min_prob = float(candidate_min_prob)
        self._trees = LayoutCache()
        self._calib = policy.AcceptCalibration()
        self.counts = StepCounts()
        # refuses a bad value at construction, before the model is checked; rebuilt in check_model for the stride
        self.policy: policy.DraftPolicy = policy.make_policy(draft_budget, stride or 2)
        self._drafting = True  # this step's choice (plan_step)

    @property
    def token_budget(self) -> int | str | policy.DraftPolicy | None:
        """The old name of :attr:`draft_budget`."""
        return self.draft_budget

    @property
    def n(self) -> int:
        """The stride, once :meth:`check_model` has set it."""
        if self.stride is None:
            raise DLMError("ISDDecoder: the stride is known once the model is (Engine runs check_model)")
        return self.stride

    @property
    def branch_steps(self) -> dict[str, int]:
        """Verify steps, and those whose outcome had its drafts' masks in the chunk (for /metrics)."""
        return self.counts.branch_steps

    @property
    def mode_steps(self) -> dict[str, int]:
        """Decode steps by the policy's choice: drafting or plain AR (for /metrics)."""
        return self.counts.mode_steps

    @property
    def verify_len(self) -> int:
        """Tokens a row feeds in a verify step (:func:`dlm.decode.isd.tree.verify_len`)."""
        return verify_len(self.stride or 2, self.fallback, self.candidates)

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
            self.stride = policy.default_stride(spec.block_size, self.candidates)
        ok = policy.supported_strides(spec.block_size)
        if self.stride not in ok:
            warn(
                f"--stride {self.stride}: this model was trained with block_size={spec.block_size}, i.e. for "
                f"strides {', '.join(map(str, ok))}; larger strides run (output stays exact) but drafts beyond "
                f"the trained block are poor"
            )
        self.policy = policy.make_policy(self.draft_budget, self.stride, self.verify_len)

    # -- when to draft (policy) ---------------------------------------------------------------------------
    def plan_step(self, engine: Engine, rows: list[Row]) -> None:
        self._drafting = self.policy.drafting(len(rows))
        self.counts.step(self._drafting)

    def step_done(self, engine: Engine, rows: list[Row], seconds: float, tokens: int) -> None:
        self.policy.observe(len(rows), self._drafting, seconds, tokens)

    # -- chunks -------------------------------------------------------------------------------------------
    def _branches(self, st: ISDRowState) -> tuple[int, ...]:
        """Which outcomes of this verify step get their N-1 masks (:func:`~dlm.decode.isd.accept.fallback_branches`):
        for ``predict`` each draft's acceptance probability is its own probability q_i(d_i) calibrated by the
        acceptance measured so far for drafts of that probability (:class:`AcceptCalibration`)."""
        n = self.n
        if self.fallback != "predict":
            return accept.fallback_branches(self.fallback, n, [])
        conf = st.conf or [1.0] * (n - 1)
        return accept.fallback_branches(self.fallback, n, [self._calib.p_accept(i, c) for i, c in enumerate(conf)])

    def chunk_layout(self, engine: Engine, row: Row, n: int) -> Layout | None:
        st = state_of(row)
        if st.tree is not None:
            return self._trees.candidates(self.n, *st.tree)
        if not st.branches or st.branches == (0,):  # a cold, AR or plain verify chunk: a sequence
            return None
        return self._trees.branches(self.n, st.branches)

    def _room(self, engine: Engine, row: Row) -> bool:
        return row.pos + 2 * self.n - 1 <= engine.max_positions

    def prefill_suffix(self, engine: Engine, row: Row) -> list[int]:
        state_of(row).cold()
        n = self.n
        if len(row.prompt_ids) + n - 1 > engine.max_positions:
            return []
        if not self.policy.peek(len(engine.rows) + 1):  # the joining row counts itself
            return []
        return [engine.mask_id] * (n - 1)

    def chunk(self, engine: Engine, row: Row) -> list[int]:
        n, st = self.n, state_of(row)
        st.branches = st.tree = None
        if not self._drafting or not self._room(engine, row):
            # the policy says drafting does not pay now, or near the end of the context: a plain AR step (exact)
            st.cold()
            st.mode = "ar"
            return [row.last]
        m = engine.mask_id
        if st.mode == "verify" and self.candidates > 1:
            cands = st.verify_cands()
            k, fb = len(cands), self.fallback != "off"
            st.tree = (k, fb)
            return [row.last] + cands + [m] * (k + fb)
        if st.mode == "verify":
            st.branches = self._branches(st)
            return [row.last] + st.verify_drafts() + [m] * ((n - 1) * len(st.branches))
        st.mode = "cold"
        return [row.last] + [m] * (n - 1)

    # -- drafts -------------------------------------------------------------------------------------------
    def _draft(self, engine: Engine, row: Row, mask_logits: torch.Tensor, first_pos: int) -> None:
        """Drafts d_1..d_{N-1} (and their q) from the N-1 mask logits [N-1, V]; d_1 sits at ``first_pos``."""
        st = state_of(row)
        prop = propose(
            mask_logits,
            row.params,
            engine.mask_token_id,
            row.generator,
            draft=self.draft,
            candidates=self.candidates,
            min_prob=self.candidate_min_prob,
            conf=self.fallback == "predict",
        )
        st.drafts, st.q = prop.drafts, prop.q
        if prop.cands is not None:
            st.cands = prop.cands
        if prop.conf is not None:
            st.conf = prop.conf

    def _candidate_count(self, top_probs: torch.Tensor) -> int:
        """How many candidates this step verifies (:func:`~dlm.decode.isd.policy.candidate_count`)."""
        return policy.candidate_count(top_probs, self.candidate_min_prob)

    def _verified(self, row: Row, proposed: int, accepted: int) -> None:
        """A verify step checked ``proposed`` drafts and accepted ``accepted``: per-request statistics, and what
        ``predict`` learns about how often a draft of a given probability is accepted."""
        conf = state_of(row).conf
        if self.fallback == "predict" and conf:
            self._calib.observe_verify(conf, proposed, accepted)
        record_verify(row.stats, self.n - 1, proposed, accepted)

    def _next_drafts(self, engine: Engine, row: Row, logits: torch.Tensor, outcome: int) -> None:
        """After a verify step whose outcome is ``outcome`` (0: all accepted, i: first rejection at d_i): if the
        chunk carried that outcome's masks (they saw c and the accepted drafts and stand in for the next token's
        position and after), their logits give the next drafts and the next step verifies again; otherwise the
        next step cold-starts."""
        n, st = self.n, state_of(row)
        where = branch_masks(n, st.branches or (0,), outcome)
        self.counts.verify(where is not None)
        if where is None:
            st.cold()
            return
        first, offset = where
        self._draft(engine, row, logits[first : first + n - 1], row.pos + offset)
        st.mode = "verify"

    # -- consume ------------------------------------------------------------------------------------------
    def consume(self, engine: Engine, row: Row, logits: torch.Tensor) -> tuple[list[int], Keep]:
        st = state_of(row)
        # an AR step, or a prefill whose masks did not fit (the engine fed the prompt alone: one logit)
        if st.mode == "ar" or logits.shape[0] == 1:
            tok = int(next_token(logits[0], row.params, engine.mask_token_id, row.generator))
            row.last = tok
            st.cold()
            return [tok], 1
        if st.mode == "cold":
            # logits[0] at t0 -> c; logits[1 .. N-1] at masks p+1..p+N-1 -> drafts for p+2..p+N
            c = int(next_token(logits[0], row.params, engine.mask_token_id, row.generator))
            self._draft(engine, row, logits[1 : self.n], row.pos + 2)
            row.last = c
            st.mode = "verify"
            return [c], 1
        if self.candidates > 1:
            return self._consume_candidates(engine, row, logits)
        return self._consume_verify(engine, row, logits)

    def _consume_verify(self, engine: Engine, row: Row, logits: torch.Tensor) -> tuple[list[int], int]:
        """A verify step: logits[i-1] is p_i for d_i (i = 1..N-1), logits[N-1] gives the free token, the masks
        after them give the next drafts (:meth:`_next_drafts`)."""
        n, p, st = self.n, row.params, state_of(row)
        drafts = st.verify_drafts()
        m = engine.mask_token_id
        if p.greedy:
            target = suppress(logits[:n], m).argmax(-1).tolist()
            accepted, correction = accept.verify_greedy(drafts, target)
            free = target[n - 1]
        else:
            probs = probs_from_logits(logits[:n], p, m)  # [N, V]
            accepted, correction = accept.verify_sampled(probs, st.draft_q(), drafts, row.generator)
            free = None if correction is not None else int(sample(probs[n - 1], row.generator))
        if correction is not None:
            self._verified(row, accepted + 1, accepted)
            row.last = correction
            self._next_drafts(engine, row, logits, accepted + 1)
            return drafts[:accepted] + [correction], accepted + 1
        assert free is not None
        self._verified(row, n - 1, n - 1)
        self._next_drafts(engine, row, logits, 0)
        row.last = free
        return drafts + [free], n

    def _consume_candidates(self, engine: Engine, row: Row, logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """A candidate verify step (stride 2): logits[0] at c is p for the next token, logits[j] at d^j the
        distribution after it, logits[K + j] at M^j the next draft after d^j, logits[2K + 1] at F (if fed) the next
        draft after a rejection. Sampling: :func:`~dlm.decode.isd.accept.recursive_rejection`. Keeps the KV of c and the accepted
        candidate (chunk indices, not a count: the candidates share a position)."""
        p, st = row.params, state_of(row)
        cands = st.verify_cands()
        k = len(cands)
        m = engine.mask_token_id
        if p.greedy:
            token = int(suppress(logits[0], m).argmax())
            hit = accept.greedy_candidate(cands, token)
        else:
            hit, token = accept.recursive_rejection(
                probs_from_logits(logits[0], p, m), st.draft_q()[0], cands, row.generator
            )
        if hit is not None:
            self.counts.verify(True)
            self._verified(row, 1, 1)
            free = int(next_token(logits[1 + hit], p, m, row.generator))
            self._draft(engine, row, logits[1 + k + hit : 2 + k + hit], row.pos + 3)
            st.mode = "verify"
            row.last = free
            return [token, free], [0, 1 + hit]
        with_f = logits.shape[0] > 1 + 2 * k  # F: the masks of the rejection branch
        self.counts.verify(with_f)
        self._verified(row, 1, 0)
        row.last = token
        if with_f:
            self._draft(engine, row, logits[1 + 2 * k : 2 + 2 * k], row.pos + 2)
            st.mode = "verify"
        else:
            st.cold()
        return [token], [0]
