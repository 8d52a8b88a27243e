"""Masked-diffusion samplers for bidirectional ``mdm`` DLMs (docs/algorithms.md#mdm-sampling), as a decoder of the batching engine.

Every generated position starts as M and the passes run with full (bidirectional) attention. With the model's
``shift`` (DiffuLLaMA/Dream), the logit at i-1 scores position i; without it (LLaDA), the logit at i.

- ``confidence`` (low-confidence remasking): each of ``steps`` passes predicts every masked position and commits
  the most confident so that ``floor(n0 * (T - s) / T)`` stay masked after pass s (none after the last).
- ``random``: at step k = T-1 .. 0 every still-masked position is committed with probability 1/(k+1) (so all are
  resolved at k = 0); tokens by temperature/top-p sampling. A step that would commit nothing skips its forward.
- ``llada`` (LLaDA's sampler): semi-autoregressive blocks of ``semi_ar_block``, ``steps`` passes split evenly over
  the blocks and each block's masks split evenly over its passes (the remainder to the first ones); each pass
  commits the block's masks with the highest probability of their proposed token (``remasking='low_confidence'``,
  at temperature 1) or random scores (``'random'``). ``cfg_scale > 0``: classifier-free guidance, the logits
  ``u + (cfg_scale + 1) (c - u)`` of the conditional sequence c and the one with the prompt masked u, both in one
  forward (two copies in the row's chunk, each attending to itself only, both at positions 0..).
- ``dream`` (Dream's ``diffusion_generate``): ``t = linspace(1, eps, steps + 1)``; at pass i every mask is revealed
  with probability ``1 - t[i+1]/t[i]`` (``alg='origin'``), or the ``int(n_masked (1 - t[i+1]/t[i]))`` masks of
  highest confidence are (``maskgit_plus``: the token's probability, ``topk_margin``: top-1 minus top-2,
  ``entropy``: the negative entropy; drawn from ``softmax(confidence / alg_temp)`` when ``alg_temp > 0``), all
  of them at the last pass. The count is per row (the reference averages it over the batch), in float32 as Dream's;
  the masks are chosen over the whole sequence (non-masks at -inf), so ties break at Dream's positions.
- ``threshold`` (Fast-dLLM): semi-autoregressive blocks of ``semi_ar_block``; within a block each pass commits every
  masked token whose probability exceeds ``threshold`` (at least the most confident one). The KV of the finished
  prefix is cached: refreshed by one full forward at the start of each block, reused by the block's later passes
  (approximate for a bidirectional model, as in Fast-dLLM).

On the engine (:class:`dlm.decode.engine.Engine`) a batch of requests with different prompt lengths, lengths and
schedules runs together: each step is one forward of every running row's sequence (``confidence``/``random``: the
whole sequence, nothing cached; ``threshold``: the part after the cached prefix). Committed tokens are final, so a
row streams the resolved prefix of its answer as it grows, and stops as soon as that prefix holds a stop token
(the passes the reference would still spend on positions after the stop are saved; the tokens are the same).
The first pass is the request's prefill forward.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from dlm.decode.configs import MDMConfig
from dlm.decode.engine import Decoder, Engine, Row
from dlm.decode.sampling import SamplingParams, check_fits_context, next_token, probs_from_logits, sample, suppress
from dlm.errors import DLMError


def propose(logits: torch.Tensor, params: SamplingParams, mask_id: int | None, generator: torch.Generator):
    """[n, V] logits -> (tokens [n], confidence [n]) on the CPU, where the rows' sequences live (the logits may be
    on a GPU): argmax or a draw, and its probability (at temperature 1 for greedy, so confidences stay
    comparable)."""
    if params.greedy:
        probs = suppress(logits, mask_id).softmax(-1)
        tokens = probs.argmax(-1)
    else:
        probs = probs_from_logits(logits, params, mask_id)
        tokens = sample(probs, generator)
    return tokens.cpu(), probs.gather(-1, tokens[:, None]).squeeze(-1).cpu()


def dream_ratio(t: torch.Tensor, i: int, steps: int) -> torch.Tensor:
    """The share of the masks Dream reveals at pass ``i`` of ``steps`` (``t``: its float32 ``linspace(1, eps,
    steps + 1)``): ``1 - t[i+1] / t[i]`` in float32 as its code computes it, 1 at the last pass."""
    return torch.ones(()) if i >= steps - 1 else 1 - t[i + 1] / t[i]


def dream_reveal_count(n_masked: int, t: torch.Tensor, i: int, steps: int) -> int:
    """How many masks Dream's confidence algorithms reveal at pass ``i`` of ``steps``: ``int(n *``
    :func:`dream_ratio` ``)`` in float32 as its code computes it (the count a float32 tensor), every mask at the last
    pass. In float64 some (length, steps, pass) give one fewer."""
    if i >= steps - 1:
        return n_masked
    return int(torch.tensor(n_masked, dtype=torch.float32) * dream_ratio(t, i, steps))


def even_split(n: int, parts: int) -> list[int]:
    """``n`` split over ``parts`` as evenly as possible, the remainder to the first parts."""
    base, rest = divmod(n, parts)
    return [base + (1 if i < rest else 0) for i in range(parts)]


def llada_quotas(gen_length: int, block_length: int, steps: int) -> list[list[int]]:
    """Per semi-autoregressive block, the masks each of its passes commits (LLaDA's schedule: ``steps`` split
    evenly over the blocks, each block's masks evenly over its passes; the last block may be shorter)."""
    blocks = math.ceil(gen_length / block_length)
    if steps < blocks:
        raise DLMError(
            f"--steps {steps} is fewer than the {blocks} blocks of --semi-ar-block {block_length} in "
            f"{gen_length} tokens; give at least one pass per block"
        )
    sizes = [min(block_length, gen_length - b * block_length) for b in range(blocks)]
    return [even_split(size, s) for size, s in zip(sizes, even_split(steps, blocks))]


class DiffusionDecoder(Decoder):
    """What the whole-sequence decoders (mdm, block) share: the row's sequence ``x`` (prompt + masks) laid out at
    once, emission of the resolved prefix in order, and the context check."""

    causal = False
    shift: bool  # set by each decoder: the logit at i-1 scores position i

    fills_middle = False  # whether a request's suffix_ids (text after the answer) are taken (mdm)

    def check_request(self, engine: Engine, row: Row) -> None:
        extra = len(row.params.suffix_ids)
        check_fits_context(len(row.prompt_ids) + extra, row.params.max_new_tokens, engine.max_positions)

    def _layout(self, engine: Engine, row: Row) -> torch.Tensor:
        p, n, after = len(row.prompt_ids), row.params.max_new_tokens, list(row.params.suffix_ids)
        x = torch.tensor(row.prompt_ids + [engine.mask_token_id] * n + after)  # (a suffix: mdm only, checked)
        row.state.update(x=x, p=p, emitted=p)
        if after:
            row.state["end"] = p + n  # where the answer stops and the suffix begins
        return x

    def _scores(self, row: Row, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits scoring absolute ``positions``; ``logits[j]`` is the output at position ``row.pos + j``."""
        return logits[positions - row.pos - (1 if self.shift else 0)]

    def _emit(self, engine: Engine, row: Row) -> list[int]:
        """The newly resolved prefix of the answer (tokens are final once committed)."""
        x, start = row.state["x"], row.state["emitted"]
        masked = (x[start:] == engine.mask_token_id).nonzero()
        stop = start + int(masked[0]) if masked.numel() else x.numel()
        stop = min(stop, row.state.get("end", stop))  # never the suffix after the answer
        row.state["emitted"] = stop
        return x[start:stop].tolist()


class MDMDecoder(DiffusionDecoder):
    name = "mdm"
    fills_middle = True  # a bidirectional model sees the suffix while it fills the masks before it

    def __init__(
        self,
        method: str | None = None,
        steps: int | None = None,
        threshold: float | None = 0.9,
        semi_ar_block: int = 32,
        cfg_scale: float = 0.0,
        remasking: str | None = None,
        alg: str | None = None,
        alg_temp: float | None = None,
        dream_top_k: int | None = None,
        eps: float = 1e-3,
    ):
        # the checks of the settings, written once (dlm.decode.configs); method None: the sampler of the model's
        # family (llada / dream), else confidence (chosen in check_model)
        MDMConfig(
            sampler=method,
            steps=steps,
            threshold=threshold,
            semi_ar_block=semi_ar_block,
            cfg_scale=cfg_scale,
            remasking=remasking,
            alg=alg,
            alg_temp=alg_temp,
            dream_top_k=dream_top_k,
        )
        if not 0.0 <= eps < 1.0:
            raise DLMError(f"the dream sampler's eps must be in [0, 1), got {eps}")
        self.cfg_scale, self.remasking = float(cfg_scale), remasking or "low_confidence"
        self.alg, self.alg_temp, self.eps = alg or "origin", alg_temp, float(eps)
        self.dream_top_k = int(dream_top_k or 0)
        threshold = 0.9 if threshold is None else float(threshold)
        self.method, self.steps, self.threshold, self.semi_ar_block = method, steps, threshold, semi_ar_block
        self.shift = True

    def check_model(self, engine: Engine) -> None:
        spec = engine.spec
        if spec is None or engine.mask_token_id is None:
            raise DLMError(
                "--decode mdm needs a DLM with a mask token; convert the model first (dlm convert --objective mdm)"
            )
        if spec.objective != "mdm":
            raise DLMError(
                f"--decode mdm needs a bidirectional masked-diffusion model (objective 'mdm'); this is "
                f"a '{spec.objective}' model: use --decode {'isd' if spec.objective == 'idlm' else 'block'}"
            )
        self.shift = bool(spec.shift)
        if self.method is None:
            from dlm.model.families import sampler_defaults  # the family's record says which sampler is its own

            self.method = sampler_defaults(engine.config, "mdm").get("sampler") or "confidence"
        if self.cfg_scale and self.method != "llada":
            raise DLMError("--cfg-scale is a setting of --sampler llada; drop it or use --sampler llada")

    def check_request(self, engine: Engine, row: Row) -> None:
        super().check_request(engine, row)
        if self.method == "llada":  # fewer steps than blocks: refused at add, not in the middle of a step
            llada_quotas(row.params.max_new_tokens, self.semi_ar_block, self.steps or row.params.max_new_tokens)

    def _cfg(self, row: Row) -> bool:
        return self.method == "llada" and self.cfg_scale > 0

    def chunk_attention(self, engine: Engine, row: Row, positions: torch.Tensor) -> torch.Tensor:
        n = positions.numel()
        if self._cfg(row):
            # [conditional | unconditional], each the whole sequence from position 0 (nothing is cached): each
            # copy sees itself only
            a = row.state["x"].numel()
            mask = torch.zeros(n, n, dtype=torch.bool)
            mask[:a, :a] = True
            mask[a:, a:] = True
            return mask
        return torch.ones(n, n, dtype=torch.bool)

    def chunk_positions(self, engine: Engine, row: Row, n: int) -> list[int] | None:
        if not self._cfg(row):
            return None
        return list(range(row.state["x"].numel())) * 2

    # -- planning: decide what the next pass commits (before its forward, so a pass that commits nothing is
    # never run), in the order the reference sampler draws its random numbers
    def _plan(self, engine: Engine, row: Row) -> None:
        st = row.state
        x = st["x"]
        masked = (x == engine.mask_token_id).nonzero().squeeze(-1)
        st["masked"] = masked
        if self.method == "confidence":
            total, n_gen = st["steps"], row.params.max_new_tokens
            while True:
                st["s"] += 1
                remain = math.floor(n_gen * (total - st["s"]) / total)
                if masked.numel() - remain > 0:
                    st["n_commit"] = masked.numel() - remain
                    return
        elif self.method == "random":
            while True:
                k = st["k"]
                st["k"] -= 1
                commit = torch.rand(masked.numel(), generator=row.generator) < 1.0 / (k + 1)
                if bool(commit.any()):
                    st["commit"] = commit
                    return
        elif self.method == "llada":
            while True:  # the next pass with a quota (a block with fewer masks than passes has empty ones)
                b, j = st["block"], st["pass_"]
                if j >= len(st["quotas"][b]):
                    st["block"], st["pass_"] = b + 1, 0
                    continue
                st["pass_"] += 1
                if st["quotas"][b][j] > 0:
                    lo = st["p"] + b * self.semi_ar_block
                    hi = min(lo + self.semi_ar_block, x.numel())
                    st.update(lo=lo, hi=hi, n_commit=st["quotas"][b][j])
                    st["masked"] = masked[(masked >= lo) & (masked < hi)]
                    return
        elif self.method == "dream":
            t = st["t"]
            while True:
                i = st["i"]
                st["i"] += 1
                if self.alg == "origin":
                    # drawn at the last pass too (ratio 1: every mask), as the reference does
                    commit = torch.rand(masked.numel(), generator=row.generator) < dream_ratio(t, i, st["steps"])
                    if bool(commit.any()):
                        st["commit"] = commit
                        return
                else:
                    n = dream_reveal_count(masked.numel(), t, i, st["steps"])
                    if n > 0:
                        st["n_commit"] = n
                        return

    def prefill_suffix(self, engine: Engine, row: Row) -> list[int]:
        self._layout(engine, row)
        p, shift = len(row.prompt_ids), 1 if self.shift else 0
        row.state.update(steps=self.steps or row.params.max_new_tokens, s=0)
        row.state["k"] = row.state["steps"] - 1
        if self.method == "threshold":
            row.state.update(start=p, c=p - shift, refresh=False)
        if self.method == "llada":
            row.state.update(
                quotas=llada_quotas(row.params.max_new_tokens, self.semi_ar_block, row.state["steps"]), block=0, pass_=0
            )
        if self.method == "dream":
            row.state.update(t=torch.linspace(1, self.eps, row.state["steps"] + 1), i=0)
        self._plan(engine, row)
        rest = row.state["x"][p:].tolist()  # the masks (and a suffix after them)
        if self._cfg(row):
            rest += self._uncond(engine, row).tolist()
        return rest

    def _uncond(self, engine: Engine, row: Row) -> torch.Tensor:
        """The sequence with its prompt masked (classifier-free guidance's unconditional input)."""
        u = row.state["x"].clone()
        u[: row.state["p"]] = engine.mask_token_id
        u[row.state.get("end", u.numel()) :] = engine.mask_token_id  # a suffix conditions too
        return u

    def chunk(self, engine: Engine, row: Row) -> list[int]:
        x = row.state["x"]
        if self._cfg(row):
            return x.tolist() + self._uncond(engine, row).tolist()
        if self.method != "threshold":
            return x.tolist()  # the whole sequence, at positions 0.. (row.pos stays 0: nothing is cached)
        if row.state.pop("refresh", False):
            row.fresh = True  # a full forward at the start of a block: recompute the prefix KV
            row.pos = 0
            return x.tolist()
        return x[row.pos :].tolist()

    def consume(self, engine: Engine, row: Row, logits: torch.Tensor) -> tuple[list[int], int]:
        st, p = row.state, row.params
        x = st["x"]
        if self.method == "threshold":
            return self._consume_threshold(engine, row, logits)
        if self.method in ("llada", "dream"):
            self._commit_family(engine, row, logits)
            out = self._emit(engine, row)
            if bool((x == engine.mask_token_id).any()):
                self._plan(engine, row)
            return out, -row.pos
        masked = st["masked"]
        tokens, conf = propose(self._scores(row, logits, masked), p, engine.mask_token_id, row.generator)
        if self.method == "confidence":
            top = conf.topk(st["n_commit"]).indices
            x[masked[top]] = tokens[top]
        else:
            commit = st["commit"]
            x[masked[commit]] = tokens[commit]
        out = self._emit(engine, row)
        if bool((x == engine.mask_token_id).any()):
            self._plan(engine, row)
        return out, -row.pos  # nothing is cached: the next pass feeds the whole sequence again

    def _commit_family(self, engine: Engine, row: Row, logits: torch.Tensor) -> None:
        """One pass of the llada or dream sampler: propose tokens for the planned masks and commit some."""
        st, p, mask_id, g = row.state, row.params, engine.mask_token_id, row.generator
        x, masked = st["x"], st["masked"]
        if self._cfg(row):
            n = x.numel() - row.pos
            cond, uncond = logits[:n], logits[n : 2 * n]
            logits = uncond + (self.cfg_scale + 1.0) * (cond - uncond)
        scores = self._scores(row, logits, masked)
        if self.method == "llada":
            tokens = next_token(scores, p, mask_id, g)
            if self.remasking == "low_confidence":
                conf = suppress(scores, mask_id).softmax(-1).gather(-1, tokens[:, None]).squeeze(-1).cpu()
            else:
                conf = torch.rand(tokens.numel(), generator=g)
            top = conf.topk(st["n_commit"]).indices
            x[masked[top]] = tokens.cpu()[top]
            return
        # Dream's sample_tokens: temperature, then top-p, then top-k (its hidden 50 where the request sets none)
        top_k = p.top_k or self.dream_top_k
        if self.alg == "origin":
            commit = st["commit"]
            sub = scores[commit.to(scores.device)]
            if p.greedy:
                tokens = next_token(sub, p, mask_id, g)  # the argmax survives any filter
            else:
                tokens = sample(probs_from_logits(sub, replace(p, top_k=top_k), mask_id, top_p_first=True), g)
            x[masked[commit]] = tokens.cpu()
            return
        # Dream's confidence algorithms: the distribution after the filters (at temperature 1 when greedy), its
        # argmax or a draw, and a confidence per mask
        params = replace(p, temperature=1.0, top_k=top_k) if p.greedy else replace(p, top_k=top_k)
        probs = probs_from_logits(scores, params, mask_id, top_p_first=True)
        tokens = probs.argmax(-1) if p.greedy else sample(probs, g)
        if self.alg == "maskgit_plus":
            conf = probs.gather(-1, tokens[:, None]).squeeze(-1)
        elif self.alg == "topk_margin":
            top2 = probs.topk(2, dim=-1).values
            conf = top2[:, 0] - top2[:, 1]
        else:  # entropy: sum p log p (higher = more certain)
            conf = (probs * torch.log(probs + 1e-10)).sum(-1)
        # Dream selects over the whole sequence with the non-masks at -inf, not over the masks alone: among equal
        # confidences (many are exactly 1 under top-p) torch.topk returns other positions on the longer row
        # (on the logits' device, as Dream runs it there; the request's generator draws on the CPU)
        full = torch.full((x.numel(),), float("-inf"), dtype=conf.dtype, device=conf.device)
        full[masked.to(conf.device)] = conf
        proposed = x.clone()  # the proposals at the masks (only masks can be chosen: the rest are at -inf)
        proposed[masked] = tokens.cpu()
        k = st["n_commit"]
        if self.alg_temp:
            chosen = torch.multinomial((full / self.alg_temp).softmax(-1).cpu(), k, generator=g)
        else:
            chosen = full.topk(k).indices.cpu()
        x[chosen] = proposed[chosen]

    def _consume_threshold(self, engine: Engine, row: Row, logits: torch.Tensor) -> tuple[list[int], int]:
        st = row.state
        x, start, c = st["x"], st["start"], st["c"]
        limit = st.get("end", x.numel())
        end = min(start + self.semi_ar_block, limit)
        keep = c - row.pos  # a refresh (or the prefill) keeps the prefix before the block; later passes nothing
        masked = (x[start:end] == engine.mask_token_id).nonzero().squeeze(-1) + start
        tokens, conf = propose(self._scores(row, logits, masked), row.params, engine.mask_token_id, row.generator)
        commit = conf > self.threshold
        commit[conf.argmax()] = True
        x[masked[commit]] = tokens[commit]
        if not bool((x[start:end] == engine.mask_token_id).any()) and end < limit:
            start = end  # next block: its first pass refreshes the prefix cache
            st.update(start=start, c=start - (1 if self.shift else 0), refresh=True)
        return self._emit(engine, row), keep
