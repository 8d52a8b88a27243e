"""Uniform-noise ("renoising") block-diffusion models: the forward every such model gives dlm, and the shape an AR
model takes when ``dlm convert --objective renoise`` turns it into one (docs/algorithms.md#uniform-noise-diffusion).

A renoising model reads a sequence whose tokens are of two kinds: *context* tokens (the prompt and committed
canvases; causal, like an AR model - their KV is what later canvases read) and *noisy* canvas tokens (bidirectional
within their canvas, over the context before the canvas). A noisy token's input embedding is mixed with the
*self-conditioning* signal (the soft embedding of the previous step's prediction) by a small gated MLP between
two RMS norms. :class:`RenoiseLM` holds that logic once; a subclass says how its model embeds, runs its layers
and projects to logits:

- :class:`dlm.model.families.diffusion_gemma.DiffusionGemmaLM`: transformers' ``DiffusionGemmaForBlockDiffusion``
  (its encoder and decoder share the layers, so one pass runs both);
- :class:`ConvertedRenoiseLM`: any Hugging Face causal LM (Llama, Qwen2/3, Gemma, ...) with a new
  self-conditioning block (zero-initialised output, so the converted model starts as the AR model on every token);
  it is saved beside the untouched weights in ``dlm_self_conditioning.safetensors``.

The forward takes the engine's arguments (tokens, positions, a boolean ``[B, 1, Q, K + Q]`` mask over the cached
keys and the chunk, the cache) and, for the noisy tokens:

- ``canvas_from [B]`` (decoding): chunk tokens at or after this position are the canvas; or ``noisy [B, Q]``
  and ``ref [B, Q]`` (training, where a row holds many canvases): which tokens are noisy, and each query's
  reference position for the sliding windows (a noisy token's canvas start, a context token's own position);
- ``soft [B, Q, H]``: the self-conditioning signal of the noisy tokens (:meth:`RenoiseLM.soft_embeddings`;
  zeros: none, as on a canvas's first step);
- ``key_positions [B, K]``: each cached key's position (the sliding windows need them).

Sliding-window layers (where the model has them) follow a sliding KV cache: a context token at q sees the keys at
``q - W < k <= q``; a noisy token whose canvas starts at s sees the context keys at ``k > s - W`` and its canvas.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dlm.errors import DLMError

SELF_CONDITIONING_FILE = "dlm_self_conditioning.safetensors"


def unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class RenoiseLM(nn.Module):
    """The renoising forward over a wrapped Hugging Face model ``self.hf`` (see the module doc)."""

    window: int | None = None  # the sliding window of the "sliding_attention" layers (None: no such layers)
    softcap: float | None = None  # the final logits' soft cap (None: none)

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf
        self.config = unwrapped(hf).config
        self.layer_types = ["full_attention"]

    # -- what a model defines ------------------------------------------------------------------------------
    def get_input_embeddings(self) -> nn.Embedding:
        raise NotImplementedError

    @property
    def mixer(self) -> nn.Module:
        """The self-conditioning block: ``mixer(embeddings, signal)``."""
        raise NotImplementedError

    def body(self, h: torch.Tensor, masks: dict, pos: torch.Tensor, cache) -> torch.Tensor:
        """The final (normed) hidden states of input embeddings ``h`` under ``masks`` (one per layer type)."""
        raise NotImplementedError

    def head(self) -> nn.Module:
        return unwrapped(self.hf).lm_head

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.get_input_embeddings()(ids)

    def save_folder(self, hf: nn.Module, folder: Path) -> None:
        """Write ``hf`` (this model's transformers model, adapters merged) and what this model adds to ``folder``."""
        raise NotImplementedError

    def save_pretrained(self, folder, merge_lora: bool = True) -> None:
        hf = self.hf
        if hasattr(hf, "merge_and_unload"):
            if not merge_lora:
                raise DLMError("saving unmerged peft adapters is not supported; use merge_lora=True")
            import copy

            hf = copy.deepcopy(hf).merge_and_unload()
        self.save_folder(hf, Path(folder))

    def add_lora(self, peft_config) -> None:
        """Plain (peft) LoRA on the transformers model; what this wrapper adds itself stays fully trainable."""
        import dataclasses

        from peft import get_peft_model

        # a plain PeftModel: the causal-LM task wrapper expects transformers' generate, which dlm does not call here
        self.hf = get_peft_model(self.hf, dataclasses.replace(peft_config, task_type=None))

    # -- shared --------------------------------------------------------------------------------------------
    def soft_embeddings(self, logits: torch.Tensor) -> torch.Tensor:
        """The self-conditioning signal of ``logits [..., V]``: ``softmax`` (float32) times the input embedding
        matrix, times the embedding's scale where it has one (Gemma's)."""
        emb = self.get_input_embeddings()
        probs = logits.softmax(dim=-1, dtype=torch.float32).to(emb.weight.dtype)
        out = torch.matmul(probs, emb.weight)
        scale = getattr(emb, "embed_scale", None)
        return out * scale.to(emb.weight.dtype) if scale is not None else out

    def masks(self, mask, pos, noisy, ref, key_positions) -> dict:
        """{layer type: [B, 1, Q, K + Q] mask}: ``mask`` for full layers, with the sliding window for the others
        (``mask`` None: a plain causal forward over the chunk, noisy tokens seeing their whole chunk as well)."""
        b, q = pos.shape
        if mask is None:
            mask = torch.ones(q, q, dtype=torch.bool, device=pos.device).tril_()[None, None].expand(b, 1, q, q)
            if noisy is not None:
                mask = mask | (noisy[:, None, :, None] & noisy[:, None, None, :])
        out = {"full_attention": mask}
        if "sliding_attention" in self.layer_types and self.window:
            keys = pos if key_positions is None else torch.cat([key_positions.to(pos.device), pos], dim=1)
            ref = pos if ref is None else ref
            near = (ref[:, :, None] - keys[:, None, :]) < self.window  # noisy queries: ref <= every canvas key
            out["sliding_attention"] = mask & near.view(b, 1, q, -1)
        return out

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        logits_to_keep: int = 0,
        canvas_from: torch.Tensor | None = None,
        noisy: torch.Tensor | None = None,
        ref: torch.Tensor | None = None,
        soft: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
        **kwargs,
    ):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        b, q = input_ids.shape
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        if position_ids is None:
            position_ids = torch.arange(q, device=input_ids.device)[None].expand(b, q)
        if attention_mask is not None and attention_mask.dim() != 4:
            raise DLMError("a renoising model takes a boolean 4-D attention mask [B, 1, Q, K + Q] (or None)")
        if canvas_from is not None:
            canvas_from = canvas_from.to(position_ids.device)[:, None]
            noisy = position_ids >= canvas_from
            ref = torch.where(noisy, canvas_from, position_ids)
        h = self.embed(input_ids)
        if noisy is not None and bool(noisy.any()):
            signal = torch.zeros_like(h) if soft is None else soft.to(h.dtype)
            h = torch.where(noisy[..., None], self.mixer(h, signal), h)
        masks = self.masks(attention_mask, position_ids, noisy, ref, key_positions)
        h = self.body(h, masks, position_ids, cache)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.head()(h).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return CausalLMOutputWithPast(logits=logits)  # the cache is the caller's, written in place


class SelfConditioning(nn.Module):
    """The self-conditioning block of a converted model: ``post_norm(e + down(act(gate(n)) * up(n)))`` with
    ``n = pre_norm(signal)`` (DiffusionGemma's shape); ``down`` starts at zero, so a new block passes the
    embeddings through its (scale-free) post norm only."""

    def __init__(self, hidden: int, intermediate: int, eps: float = 1e-6, act: str = "silu"):
        super().__init__()
        from transformers.activations import ACT2FN

        self.pre_norm = nn.RMSNorm(hidden, eps=eps)
        self.post_norm = nn.RMSNorm(hidden, eps=eps, elementwise_affine=False)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = ACT2FN[act]
        nn.init.zeros_(self.down_proj.weight)

    def forward(self, embeddings: torch.Tensor, signal: torch.Tensor) -> torch.Tensor:
        n = self.pre_norm(signal)
        return self.post_norm(embeddings + self.down_proj(self.act(self.gate_proj(n)) * self.up_proj(n)))


class ConvertedRenoiseLM(RenoiseLM):
    """Any Hugging Face causal LM as a renoising model: its own layers under the masks (one for every layer: a
    converted model attends as it is trained here, without sliding windows), its head, and a
    :class:`SelfConditioning` block of its own."""

    def __init__(self, hf: nn.Module, self_conditioning: SelfConditioning | None = None):
        super().__init__(hf)
        c = self.config
        width = int(c.hidden_size)
        act = getattr(c, "hidden_act", None) or getattr(c, "hidden_activation", None) or "silu"
        self.self_conditioning = self_conditioning or SelfConditioning(
            width, int(getattr(c, "intermediate_size", 4 * width)), float(getattr(c, "rms_norm_eps", 1e-6)), act
        ).to(next(hf.parameters()).dtype)
        self.softcap = getattr(c, "final_logit_softcapping", None)

    def get_input_embeddings(self) -> nn.Embedding:
        return unwrapped(self.hf).get_input_embeddings()

    @property
    def mixer(self) -> nn.Module:
        return self.self_conditioning

    def body(self, h, masks, pos, cache):
        from dlm.model.convert import cache_kw  # a circle: convert <-> hub, families, renoise

        base = unwrapped(self.hf).model
        kw = {cache_kw(unwrapped(self.hf)): cache} if cache is not None else {}
        out = base(
            inputs_embeds=h, attention_mask=masks["full_attention"], position_ids=pos, use_cache=cache is not None, **kw
        )
        return out.last_hidden_state

    def save_folder(self, hf: nn.Module, folder: Path) -> None:
        from safetensors.torch import save_file

        hf.save_pretrained(folder)
        state = {k: v.detach().cpu().contiguous() for k, v in self.self_conditioning.state_dict().items()}
        save_file(state, str(Path(folder) / SELF_CONDITIONING_FILE), metadata={"format": "dlm-self-conditioning"})

    def load_extra(self, folder: Path) -> None:
        from safetensors.torch import load_file

        path = Path(folder) / SELF_CONDITIONING_FILE
        if not path.is_file():
            raise DLMError(
                f"'{folder}' is a renoising DLM (config.json dlm_objective 'renoise') but {SELF_CONDITIONING_FILE} "
                f"is missing; copy the whole checkpoint folder"
            )
        state = load_file(str(path))
        want = set(self.self_conditioning.state_dict())
        if set(state) != want:
            raise DLMError(f"'{path}' does not hold a self-conditioning block (expected {sorted(want)})")
        dtype = next(self.self_conditioning.parameters()).dtype
        self.self_conditioning.load_state_dict({k: v.to(dtype) for k, v in state.items()})
