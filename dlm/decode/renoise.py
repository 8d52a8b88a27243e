"""Uniform-noise ("renoising") block diffusion, DiffusionGemma's sampler, as a decoder of the batching engine
(docs/algorithms.md#uniform-noise-diffusion).

The answer is written canvas by canvas (``canvas_length`` tokens, left to right). A canvas starts as tokens drawn
uniformly from the vocabulary. Each of at most ``steps`` denoising steps (counted down, n = N .. 1):

1. the model scores the canvas (bidirectionally, over the cached context), self-conditioned on the previous step's
   scaled logits (none on a canvas's first step);
2. the logits are divided by the temperature ``t_min + (t_max - t_min) * n / N``; a token is sampled at every
   position, and the argmax kept as the canvas's current reading;
3. the positions are sorted by the entropy of their scaled distribution, and the lowest ones accepted while the
   sum of their entropies less the largest stays within ``entropy_bound``: accepted positions take the sampled
   token, the others keep the canvas's token; then every position not accepted is drawn uniformly at random again;
4. the canvas stops early when its argmax has not changed over the last ``stability_threshold`` steps and the
   mean entropy of the scaled distribution is below ``confidence_threshold``.

The canvas's last argmax is committed (a stop token in it ends the request) and fed, causally, in the next
forward's chunk before the next canvas, so its KV joins the context once. A row's random draws (canvas, samples,
re-noise) come from its own generator in the order transformers' ``generate`` draws them from the global one, so
one request with a seed gives transformers' output token for token, whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dlm.decode.configs import RenoiseConfig, decoder_config, own_decoder
from dlm.decode.engine import Decoder, Engine, Row
from dlm.errors import DLMError

# transformers' DiffusionGemmaGenerationConfig defaults, for a checkpoint whose generation_config.json sets none
DEFAULTS = {
    "steps": 48,
    "entropy_bound": 0.1,
    "t_min": 0.4,
    "t_max": 0.8,
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
}


@dataclass
class CanvasState:
    """One row's canvas: its tokens, last argmax, self-conditioning logits, the step count-down and history."""

    start: int  # the canvas's first position
    tokens: torch.Tensor  # [C] the current (noisy) canvas
    argmax: torch.Tensor  # [C] the latest reading
    step: int  # the step about to run, counted down from N to 1
    history: torch.Tensor | None  # [S, C] the last S readings (stability), -1 before any
    self_cond: torch.Tensor | None = None  # [C, V] the previous step's scaled logits
    encode: list[int] = field(default_factory=list)  # a committed canvas, fed before this one in the next chunk


def accept_mask(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """The entropy-bounded acceptance: with entropies sorted ascending, position j (in that order) is accepted when
    the sum of the first j+1 entropies less the (largest) j-th stays within ``bound``."""
    ordered, order = torch.sort(entropy, dim=-1, descending=False)
    chosen = torch.cumsum(ordered, dim=-1) - ordered <= bound
    return torch.scatter(torch.zeros_like(chosen), -1, order, chosen)


class RenoiseDecoder(Decoder):
    name = "renoise"
    causal = False
    static_ok = False  # its forward takes the canvas start and the self-conditioning signal

    def __init__(self, config: RenoiseConfig | None = None):
        self.config = config = decoder_config(RenoiseConfig, config)
        s = {k: (DEFAULTS[k] if getattr(config, k) is None else getattr(config, k)) for k in DEFAULTS}
        if not s["t_max"] > s["t_min"]:
            raise DLMError(f"--t-max ({s['t_max']}) must be above --t-min ({s['t_min']})")
        self.steps, self.entropy_bound = int(s["steps"]), float(s["entropy_bound"])
        self.t_min, self.t_max = float(s["t_min"]), float(s["t_max"])
        self.stability, self.confidence = int(s["stability_threshold"]), float(s["confidence_threshold"])
        self.canvas = 0
        self.vocab = 0

    def check_model(self, engine: Engine) -> None:
        spec = engine.spec
        lm = getattr(engine.model, "renoise", None)
        if spec is None or spec.objective != "renoise" or lm is None:
            what = "a plain causal LM" if spec is None else f"a '{spec.objective}' model"
            raise DLMError(
                f"--decode renoise needs a uniform-noise (renoising) DLM such as a DiffusionGemma checkpoint; this "
                f"is {what}: use --decode {own_decoder(None if spec is None else spec.objective)}"
            )
        self.canvas = int(spec.block_size)
        self.vocab = int(lm.get_input_embeddings().weight.shape[0])
        self._soft = lm.soft_embeddings

    def check_request(self, engine: Engine, row: Row) -> None:
        # (log-probabilities, logit adjustments and a suffix: refused by the engine for every non-causal decoder)
        p = row.params
        n = -(-p.max_new_tokens // self.canvas) * self.canvas
        if len(row.prompt_ids) + n > engine.max_positions:
            raise DLMError(
                f"the prompt ({len(row.prompt_ids)} tokens) and {n} canvas tokens (--max-new-tokens "
                f"{p.max_new_tokens} in canvases of {self.canvas}) exceed the model's {engine.max_positions} "
                f"positions; shorten the prompt or lower --max-new-tokens"
            )

    def chunk_attention(self, engine: Engine, row: Row, positions: torch.Tensor) -> torch.Tensor:
        """Context tokens (before the canvas) causal, never seeing the canvas; the canvas sees the whole chunk."""
        canvas = positions >= row.state.start
        mask = positions[None, :] <= positions[:, None]
        return mask | canvas[:, None]

    def _new_canvas(self, row: Row, start: int) -> CanvasState:
        tokens = torch.randint(0, self.vocab, (1, self.canvas), generator=row.generator)[0]
        history = torch.full((self.stability, self.canvas), -1, dtype=torch.long) if self.stability else None
        return CanvasState(start=start, tokens=tokens, argmax=tokens, step=self.steps, history=history)

    def prefill_suffix(self, engine: Engine, row: Row) -> list[int]:
        row.state = self._new_canvas(row, len(row.prompt_ids))
        return row.state.tokens.tolist()

    def chunk(self, engine: Engine, row: Row) -> list[int]:
        st: CanvasState = row.state
        return st.encode + st.tokens.tolist()

    def model_inputs(self, engine: Engine, rows: list[Row], pos: torch.Tensor, valid: torch.Tensor) -> dict:
        starts = torch.tensor([r.state.start for r in rows], device=pos.device)
        soft = None
        for i, r in enumerate(rows):
            if r.state.self_cond is not None:
                if soft is None:
                    width = engine.model.renoise.get_input_embeddings().weight.shape[1]
                    soft = torch.zeros(*pos.shape, width, device=pos.device)
                at = r.state.start - int(pos[i, 0])
                soft[i, at : at + self.canvas] = self._soft(r.state.self_cond.to(pos.device))
        keys = valid.to(pos.device)
        key_pos = torch.where(keys, keys.long().cumsum(1) - 1, torch.full_like(keys, -(1 << 30), dtype=torch.long))
        return {"canvas_from": starts, "soft": soft, "key_positions": key_pos}

    def _step(self, row: Row, logits: torch.Tensor) -> bool:
        """One denoising step of the row's canvas on its ``logits [C, V]``; whether the canvas is done."""
        st: CanvasState = row.state
        # the schedule in transformers' arithmetic (an int32 step over N, in float32)
        temperature = self.t_min + (self.t_max - self.t_min) * (torch.tensor(st.step, dtype=torch.int32) / self.steps)
        scaled = logits.float() / temperature
        probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
        sampled = torch.multinomial(probs, num_samples=1, generator=row.generator).squeeze(-1)
        argmax = torch.argmax(scaled, dim=-1)
        entropy = torch.distributions.Categorical(logits=scaled).entropy()
        accepted = accept_mask(entropy, self.entropy_bound)
        kept = torch.where(accepted, sampled, st.tokens)
        noise = torch.randint(0, self.vocab, (1, self.canvas), generator=row.generator)[0]
        st.tokens = torch.where(accepted, kept, noise)
        st.argmax = argmax
        if st.history is None:
            stable = True
        else:
            stable = bool((st.history == argmax[None]).all())
            st.history = torch.roll(st.history, shifts=-1, dims=0)
            st.history[-1] = argmax
        confident = float(entropy.mean()) < self.confidence
        st.self_cond = scaled
        st.step -= 1
        return (stable and confident) or st.step == 0

    def consume(self, engine: Engine, row: Row, logits: torch.Tensor) -> tuple[list[int], int]:
        st: CanvasState = row.state
        at = st.start - row.pos  # the canvas's first logits row; the tokens before it are context and keep their KV
        done = self._step(row, logits[at : at + self.canvas].cpu())
        st.encode = []
        if not done:
            return [], at
        committed = st.argmax.tolist()
        row.stats.canvas_steps.append(self.steps - st.step)
        nxt = self._new_canvas(row, st.start + self.canvas)
        nxt.encode = committed
        row.state = nxt
        return committed, at
