"""The ISD decoder on the engine (the algorithm: :mod:`dlm.decode.isd`, docs/algorithms.md#isd): the Decoder
protocol's methods, each building a chunk or reading logits through the pure parts (:mod:`~dlm.decode.isd.draft`,
:mod:`~dlm.decode.isd.accept`, :mod:`~dlm.decode.isd.tree`, :mod:`~dlm.decode.isd.policy`) and keeping the row's
:class:`~dlm.decode.isd.state.ISDRowState`."""

from __future__ import annotations

import torch

from dlm.decode.configs import ISDConfig, decoder_config
from dlm.decode.engine import Decoder, Engine, Keep, Row, warn
from dlm.decode.isd import accept, batch, policy
from dlm.decode.isd.accept import verify_forced
from dlm.decode.isd.draft import propose
from dlm.decode.isd.state import ISDRowState
from dlm.decode.isd.stats import StepCounts, record_verify
from dlm.decode.isd.tree import Layout, LayoutCache, branch_masks, verify_len
from dlm.decode.sampling import SamplingParams, argmax_no_mask, next_token, probs_from_logits, sample
from dlm.errors import DLMError


def outcome_of(accepted: int, n: int) -> int:
    """A verify step's outcome from its accepted count: i when d_i was the first rejected draft (accepted = i - 1),
    0 when all N-1 drafts were accepted."""
    return accepted + 1 if accepted < n - 1 else 0


def state_of(row: Row) -> ISDRowState:
    """The row's ISD state (created at its first use: the prefill)."""
    st = row.state
    if not isinstance(st, ISDRowState):
        st = row.state = ISDRowState()
    return st


class ISDDecoder(Decoder):
    """``stride`` N (None: the model's ``block_size + 1``, and then 'auto' chooses each step's stride from 2 up to
    it); ``draft``: 'sample' (exact) or 'argmax'
    (approximate); ``draft_budget``: when a step drafts (:func:`dlm.decode.schedule.make_policy`: None / 'always',
    an int, 'auto' or a policy object; ``token_budget`` is its old name, accepted with a DeprecationWarning);
    ``fallback``: which outcomes get masks for the next drafts ('predict' | 'all' | 'off'); ``candidates`` K:
    draft candidates per position (stride 2), the 2nd..K-th verified where the mask gives them at least
    ``candidate_min_prob``."""

    name = "isd"
    # consume_batch verifies all rows of a step in one batched call on the logits' device (dlm.decode.isd.batch);
    # False: row by row (consume), the reference it equals token for token; None (default): batched where the
    # logits are off the host (an accelerator: no logits cross to the host), row by row on CPU, where the logits
    # already are on the host and the per-row path measured as fast or faster (vocabulary 49,152, 1-16 rows)
    batch_verify: bool | None = None

    def __init__(self, config: ISDConfig | None = None):
        self.config = config = decoder_config(ISDConfig, config)
        stride, draft_budget = config.stride, config.draft_budget
        self.stride = stride  # None: the model's (check_model)
        self.draft = config.draft
        self.draft_budget = draft_budget
        self.fallback = config.fallback
        self.candidates = config.candidates
        self.candidate_min_prob = float(config.candidate_min_prob)
        self._trees = LayoutCache()
        self._window_cache: dict[tuple[int, ...], list[int]] = {}  # (stride, *branches) -> _windows(branches)
        self._calib = policy.AcceptCalibration()
        self.counts = StepCounts()  # steps by mode, stride and verify outcome (/metrics, quickstart, bench)
        # refuses a bad value at construction, before the model is checked; rebuilt in check_model for the stride
        self.policy: policy.DraftPolicy = policy.make_policy(draft_budget, stride or 2)
        self._drafting = True  # this step's choice (plan_step)
        self._mode: bool | int = True  # what the policy answered for this step (told back in step_done)
        self._n: int | None = None  # this step's stride (the policy may choose one below ``stride``)

    def _stride_of(self, mode: bool | int) -> int:
        """The stride of a drafting answer of the policy: True -> the decoder's stride; an int -> that stride
        (2 .. the decoder's)."""
        if isinstance(mode, bool) or mode == 1:
            return self.n_max
        if not isinstance(mode, int) or not 2 <= mode <= self.n_max:
            raise DLMError(
                f"ISD: the drafting policy answered {mode!r}; it must answer a bool or a stride 2..{self.n_max}"
            )
        return mode

    @property
    def n_max(self) -> int:
        """The stride (the largest this decoder drafts at), once :meth:`check_model` has set it."""
        if self.stride is None:
            raise DLMError("ISDDecoder: the stride is known once the model is (Engine runs check_model)")
        return self.stride

    @property
    def policy_strides(self) -> list[int] | None:
        """The strides the measured policy chooses among: with the model's stride (none given), 2 .. block_size + 1;
        None where the stride is fixed (a stride given is the one every drafting step runs at; draft candidates run
        at stride 2 only)."""
        if self.config.stride is not None or self.candidates > 1:
            return None
        return policy.supported_strides(self.n_max - 1)

    @property
    def n(self) -> int:
        """This step's stride: :attr:`n_max` unless the measured policy chose a smaller one."""
        return self._n if self._n is not None else self.n_max

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
        strides = self.policy_strides
        self.policy = policy.make_policy(self.draft_budget, self.stride, self.verify_len, strides=strides)
        self._n = None
        # 'auto' (not a policy object of the caller's): what an earlier process on this folder and machine learnt
        if isinstance(self.policy, policy.MeasuredDraft) and isinstance(self.draft_budget, str):
            n = f"2..{self.stride}" if strides is not None else self.stride  # (a chosen stride: a record of its own)
            setting = f"isd N={n} {self.fallback} K={self.candidates} p{self.candidate_min_prob} {self.draft}"
            key = policy.memory_key(engine, setting)
            if key is not None:
                self.policy.memory = policy.PolicyMemory(key)

    # -- when to draft (policy) ---------------------------------------------------------------------------
    def plan_step(self, engine: Engine, rows: list[Row]) -> None:
        self._mode = mode = self.policy.drafting(len(rows))
        self._drafting = bool(mode)
        if self._drafting:
            self._n = self._stride_of(mode)
        self.counts.step(self._drafting, self.n)

    def step_done(self, engine: Engine, rows: list[Row], seconds: float, tokens: int) -> None:
        self.policy.observe(len(rows), self._mode, seconds, tokens)

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
        st = state_of(row)
        st.cold()
        ahead = self.forced_first(row)
        if ahead:  # a structured output's forced start, verified in the prefill's forward (consume)
            st.mode, st.drafts = "forced", ahead
            return ahead
        mode = self.policy.peek(len(engine.rows) + 1)  # the joining row counts itself
        if not mode:
            return []
        n = self._stride_of(mode)  # the stride the next step most likely drafts at (consume reads the masks fed)
        if len(row.prompt_ids) + n - 1 > engine.max_positions:
            return []
        return [engine.mask_id] * (n - 1)

    def chunk(self, engine: Engine, row: Row) -> list[int]:
        n, st = self.n, state_of(row)
        st.branches = st.tree = None
        if st.mode == "forced":  # a structured output's forced tokens, whatever the drafting policy says
            return [row.last, *st.verify_drafts()]
        if not self._drafting or not self._room(engine, row):
            # the policy says drafting does not pay now, or near the end of the context: a plain AR step (exact)
            st.cold()
            st.mode = "ar"
            return [row.last]
        m = engine.mask_id
        if st.mode == "verify" and self.candidates == 1 and len(st.verify_drafts()) != n - 1:
            st.cold()  # drafted at another stride (the policy changed it): start over at this one
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
        st.drafts, st.q, st.q_src = prop.drafts, prop.q, None
        if prop.cands is not None:
            st.cands = prop.cands
        if prop.conf is not None:
            st.conf = prop.conf
        self._drafted(engine, row, first_pos)

    def _drafted(self, engine: Engine, row: Row, first_pos: int) -> None:
        """Called once a row's next drafts are in its state (either path); d_1 sits at ``first_pos``. A subclass may
        replace them (tests: oracle drafts)."""

    def forced(self, engine: Engine, row: Row, tokens: list[int]) -> None:
        """Tokens the row's grammar forces next (structured outputs: a JSON schema's keys and punctuation) make its
        next chunk ``[c, f_1..f_k]`` without masks, verified as plain AR verifies them
        (:func:`~dlm.decode.isd.accept.verify_forced`: exact); the step after cold-starts. A forced token is known
        without a forward, so this beats both the masks' own guess and a verify chunk that carries masks for them."""
        st = state_of(row)
        st.cold()
        st.mode, st.drafts = "forced", tokens

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
        if st.mode == "forced" and logits.shape[0] > len(st.verify_drafts()):
            committed, keep = verify_forced(logits, st.verify_drafts(), row.params, engine.mask_token_id, row.generator)
            row.last = committed[-1]
            st.cold()
            return committed, keep
        # an AR step, or a prefill whose masks did not fit (the engine fed the prompt alone: one logit)
        if st.mode == "ar" or logits.shape[0] == 1:
            tok = int(next_token(logits[0], row.params, engine.mask_token_id, row.generator))
            row.last = tok
            st.cold()
            return [tok], 1
        if st.mode == "cold":
            # logits[0] at t0 -> c; logits[1 ..] at the masks fed, p+1..p+N-1 -> drafts for p+2..p+N (a prefill's
            # masks follow the stride the policy expected; a decode step's, this step's)
            c = int(next_token(logits[0], row.params, engine.mask_token_id, row.generator))
            self._draft(engine, row, logits[1:], row.pos + 2)
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
            target = argmax_no_mask(logits[:n], m).tolist()
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
            token = int(argmax_no_mask(logits[0], m))
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
            row.src = [0, 1 + hit]  # free came from the accepted candidate's logits
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

    # -- consume, every row of a step in one call -----------------------------------------------------------
    _PER_ROW_STEPS = ("consume", "_consume_verify", "_draft", "_next_drafts", "_verified")

    def _batched(self, device: torch.device) -> bool:
        """Whether :meth:`consume_batch` takes the batched path: where :attr:`batch_verify` asks for it (None: the
        logits are not on the CPU), unless with draft candidates (their recursive rejection over draws without
        replacement stays per row: a handful of sequential draws, each depending on the last) or in a subclass that
        changes one of the per-row steps."""
        wanted = device.type != "cpu" if self.batch_verify is None else self.batch_verify
        if not wanted or self.candidates > 1:
            return False
        cls = type(self)
        return all(getattr(cls, name) is getattr(ISDDecoder, name) for name in self._PER_ROW_STEPS)

    def consume_batch(
        self, engine: Engine, rows: list[Row], logits: torch.Tensor, lengths: list[int]
    ) -> list[tuple[list[int], Keep]]:
        """Every row's verify-and-accept of this step in one batched call on the logits' device
        (:func:`~dlm.decode.isd.batch.accept_rows`, one call per group of rows with the same sampling settings),
        then one transfer of a few numbers per row to the host; token for token :meth:`consume` row by row, with
        each row's random draws taken from its generator in the same order."""
        if not self._batched(logits.device) or any(state_of(r).mode == "forced" for r in rows):
            return super().consume_batch(engine, rows, logits, lengths)
        n = self.n
        kinds: list[str] = [
            "ar" if state_of(r).mode == "ar" or k == 1 else state_of(r).mode for r, k in zip(rows, lengths)
        ]
        groups: dict[tuple[float, int, float], list[int]] = {}
        for i, row in enumerate(rows):
            p = row.params
            groups.setdefault((0.0, 0, 1.0) if p.greedy else (p.temperature, p.top_k, p.top_p), []).append(i)
        outs: list[torch.Tensor] = []
        at = [0] * len(rows)  # row -> its line in the step's output
        q_of: dict[int, tuple[torch.Tensor, int]] = {}
        saved: dict[int, torch.Tensor | None] = {}
        done = 0
        for idx in groups.values():
            out, q_next, group_saved = self._accept_group(engine, rows, kinds, logits, idx)
            for j, i in enumerate(idx):
                at[i] = done + j
                if q_next is not None:
                    q_of[i] = (q_next, j)
                saved[i] = group_saved[j]
            outs.append(out)
            done += len(idx)
        vals = (outs[0] if len(outs) == 1 else torch.cat(outs)).tolist()  # the step's one transfer to the host
        results: list[tuple[list[int], Keep]] = []
        for i, row in enumerate(rows):
            v, st, kind = vals[at[i]], state_of(row), kinds[i]
            accepted, tok = int(v[0]), int(v[1])
            if kind == "ar":
                row.last = tok
                st.cold()
                results.append(([tok], 1))
                continue
            if kind == "cold":
                self._store_drafts(engine, row, v, q_of.get(i), row.pos + 2)
                row.last = tok
                st.mode = "verify"
                results.append(([tok], 1))
                continue
            drafts = st.verify_drafts()
            outcome = outcome_of(accepted, n)
            self._verified(row, min(accepted + 1, n - 1), accepted)
            where = branch_masks(n, st.branches or (0,), outcome)
            self.counts.verify(where is not None)
            if where is None:
                st.cold()
                batch.rewind(row.generator, saved[i])
            else:
                self._store_drafts(engine, row, v, q_of.get(i), row.pos + where[1])
                st.mode = "verify"
            row.last = tok
            results.append((drafts[:accepted] + [tok], accepted + 1))
        return results

    def _windows(self, branches: tuple[int, ...]) -> list[int]:
        """For each accepted count a = 0..N-1 of a verify chunk carrying ``branches``: the chunk index of the first
        mask of that outcome's next drafts, -1 if the chunk does not carry them."""
        n = self.n
        key = (n, *branches)
        got = self._window_cache.get(key)
        if got is None:
            got = []
            for a in range(n):
                where = branch_masks(n, branches, outcome_of(a, n))
                got.append(-1 if where is None else where[0])
            self._window_cache[key] = got
        return got

    def _accept_group(
        self, engine: Engine, rows: list[Row], kinds: list[str], logits: torch.Tensor, idx: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor | None]]:
        """The batched verify-and-accept of the rows ``idx`` (same sampling settings): their inputs gathered into a
        few small tensors (one host-to-device copy), their random draws taken row by row, one
        :func:`~dlm.decode.isd.batch.accept_rows` call."""
        n, dev, vocab = self.n, logits.device, logits.shape[-1]
        params: SamplingParams = rows[idx[0]].params
        sub = logits[: len(idx)] if idx == list(range(len(idx))) else logits[torch.tensor(idx, device=dev)]
        verify = [kinds[i] == "verify" for i in idx]
        windows, ints = [], []
        for i, vf in zip(idx, verify):
            st = state_of(rows[i])
            if vf:
                win = self._windows(st.branches or (0,))
                ints.append([n - 1, *st.verify_drafts(), *win])
            else:
                win = [1] + [-1] * (n - 1) if kinds[i] == "cold" else [-1] * n
                ints.append([0] + [0] * (n - 1) + win)
            windows.append(win)
        small = torch.tensor(ints, dtype=torch.long).to(dev)
        any_verify = any(verify)
        may_draft = [max(w) >= 0 for w in windows]
        q = q_rows = rand = None
        saved: list[torch.Tensor | None] = [None] * len(idx)
        if not params.greedy:
            if any_verify:
                q, rows_in_q = self._stacked_q([state_of(rows[i]) if vf else None for i, vf in zip(idx, verify)])
                q_rows = torch.tensor(rows_in_q, dtype=torch.long).to(dev)
            rand, saved = batch.draws(
                [rows[i].generator for i in idx],
                verify,
                may_draft,
                [min(w) >= 0 for w in windows],
                n,
                vocab,
                sample_drafts=self.draft == "sample",
            )
        group = batch.VerifyGroup(
            n,
            small[:, 0],
            drafts=small[:, 1:n] if any_verify else None,
            windows=small[:, n:] if any(may_draft) else None,
            q=q,
            q_rows=q_rows,
            rand=rand,
        )
        out, q_next = batch.accept_rows(
            sub, params, engine.mask_token_id, group, draft=self.draft, conf=self.fallback == "predict"
        )
        return out, q_next, saved

    @staticmethod
    def _stacked_q(states: list[ISDRowState | None]) -> tuple[torch.Tensor, list[int]]:
        """The verify rows' drafts' distributions as one [R, N-1, V] tensor and each row's index in it (0 for the
        rows without drafts): the tensor the last batched step drafted them into when they all come from one (no
        copy), else the distinct ones concatenated."""
        bases: list[torch.Tensor] = []
        offset: dict[int, int] = {}
        where: list[tuple[int, int] | None] = []
        for st in states:
            if st is None:
                where.append(None)
                continue
            base, j = st.q_src if st.q_src is not None else (st.draft_q()[None], 0)
            if id(base) not in offset:
                offset[id(base)] = sum(b.shape[0] for b in bases)
                bases.append(base)
            where.append((offset[id(base)], j))
        q = bases[0] if len(bases) == 1 else torch.cat(bases)
        return q, [0 if w is None else w[0] + w[1] for w in where]

    def _store_drafts(
        self, engine: Engine, row: Row, v: list[float], q: tuple[torch.Tensor, int] | None, first_pos: int
    ) -> None:
        """A row's next drafts from the batched step's output ``v`` (accepted, token, drafts, their probabilities)
        and ``q`` (the step's [rows, N-1, V] distributions and the row's index; None when greedy)."""
        n, st = self.n, state_of(row)
        st.drafts = [int(x) for x in v[2 : n + 1]]
        st.q, st.q_src = (q[0][q[1]], q) if q is not None else (None, None)
        if self.fallback == "predict":
            st.conf = v[n + 1 : 2 * n]
        self._drafted(engine, row, first_pos)
