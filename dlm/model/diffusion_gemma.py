"""DiffusionGemma (uniform-noise "renoising" block diffusion on the Gemma 4 backbone) as a dlm model.

transformers defines the family itself (``DiffusionGemmaForBlockDiffusion``, model_type ``diffusion_gemma``): a
causal *encoder* writes the KV cache of the prompt and of every committed canvas, and a bidirectional *decoder*
reads it while it denoises the next canvas of ``canvas_length`` tokens. The two share every weight of their
layers, their final norm and the embeddings (the checkpoint ties them); the decoder alone has the
self-conditioning block, which mixes the soft embedding of the previous step's prediction into the canvas's input
embeddings. Each layer is a dense gated MLP plus a routed mixture of experts, with sliding-window and full
attention layers.

dlm loads the folder with transformers' own class (no remote code, no renamed weights) and runs it through
:class:`RenoiseLM`: one forward over the engine's usual chunk - tokens to encode (causal, their KV kept) followed
by a canvas (bidirectional over the context and itself, its KV dropped) - with the same layers. Because the
layers are shared, that is the encoder and the decoder of transformers' forward in one pass; the tests check the
logits of both parts against transformers' own forward, and :mod:`dlm.decode.renoise` against its ``generate``.

Attention follows transformers' dynamic-cache path exactly: a context token at position q sees the keys at
``q - W < k <= q`` in a sliding layer (W = ``sliding_window``); a canvas starting at s sees the context keys at
``k > s - W`` (the W - 1 tokens a sliding cache keeps) and the whole canvas; full layers see everything before.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dlm.errors import DLMError

MODEL_TYPE = "diffusion_gemma"
ARCHITECTURE = "DiffusionGemmaForBlockDiffusion"
TITLE = "DiffusionGemma"
# generation_config.json field -> the renoise decoder's setting (dlm.decode.configs.RenoiseConfig)
GENERATION_FIELDS = {
    "max_denoising_steps": "steps",
    "t_min": "t_min",
    "t_max": "t_max",
    "stability_threshold": "stability_threshold",
    "confidence_threshold": "confidence_threshold",
}


def is_diffusion_gemma(fields: dict) -> bool:
    """Whether config.json's ``fields`` describe a DiffusionGemma checkpoint."""
    archs = fields.get("architectures") or []
    return fields.get("model_type") == MODEL_TYPE or ARCHITECTURE in (archs if isinstance(archs, list) else [archs])


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config.text_config


class RenoiseLM(nn.Module):
    """A ``DiffusionGemmaForBlockDiffusion`` run as one forward over [tokens to encode | canvas] (module doc).

    ``forward`` takes the engine's arguments (``input_ids``, ``position_ids``, a boolean ``attention_mask``
    ``[B, 1, Q, K + Q]`` over the cached keys and the chunk, the cache) and three of its own:

    - ``canvas_from [B]``: the position where each row's canvas starts; chunk tokens at or after it are canvas
      (decoder) tokens, the ones before it context (encoder) tokens. None: the whole chunk is context;
    - ``soft [B, Q, H]``: the self-conditioning soft embeddings of canvas tokens (:meth:`soft_embeddings` of the
      previous step's logits; zeros = no signal, as on a canvas's first step);
    - ``key_positions [B, K]``: the position of each cached key (-1 for a hole), for the sliding windows.

    Logits are float32, soft-capped as transformers' head does; a context token's logits are the encoder's
    hidden state through the same head (the encoder's causal language-model scores).
    """

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf
        self.config = hf.config
        text = _text_config(hf.config)
        self.window = getattr(text, "sliding_window", None)
        self.layer_types = list(text.layer_types)
        self.softcap = getattr(text, "final_logit_softcapping", None)

    # the parts (transformers ties the encoder's text layers, norm and embeddings to the decoder's)
    @property
    def text(self) -> nn.Module:
        return self.hf.model.encoder.language_model

    @property
    def canvas_part(self) -> nn.Module:
        return self.hf.model.decoder

    def get_input_embeddings(self):
        return self.text.embed_tokens

    def soft_embeddings(self, logits: torch.Tensor) -> torch.Tensor:
        """The self-conditioning signal of ``logits [..., V]`` (transformers' decoder: softmax in float32, times
        the embedding matrix, times the embedding scale)."""
        emb = self.canvas_part.embed_tokens
        probs = logits.softmax(dim=-1, dtype=torch.float32).to(emb.weight.dtype)
        return torch.matmul(probs, emb.weight) * emb.embed_scale.to(emb.weight.dtype)

    def _masks(self, mask, pos, canvas_from, key_positions, q):
        """{layer type: [B, 1, Q, K + Q] mask}: ``mask`` for full layers, with the sliding window for the others."""
        if mask is None:  # a plain causal forward over the chunk (no cache)
            mask = (
                torch.ones(q, q, dtype=torch.bool, device=pos.device).tril_()[None, None].expand(pos.shape[0], 1, q, q)
            )
            if canvas_from is not None:  # canvas tokens see the whole chunk (context tokens never see the canvas)
                canvas = pos >= canvas_from[:, None]
                mask = mask | (canvas[:, None, :, None] & canvas[:, None, None, :])
        masks = {"full_attention": mask}
        if "sliding_attention" in self.layer_types and self.window:
            b = pos.shape[0]
            keys = pos if key_positions is None else torch.cat([key_positions.to(pos.device), pos], dim=1)
            ref = pos if canvas_from is None else torch.where(pos >= canvas_from[:, None], canvas_from[:, None], pos)
            near = (ref[:, :, None] - keys[:, None, :]) < self.window  # [B, Q, K + Q]; canvas keys: ref <= k
            masks["sliding_attention"] = mask & near.view(b, 1, q, -1)
        return masks

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
        canvas_from: torch.Tensor | None = None,
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
            raise DLMError("RenoiseLM takes a boolean 4-D attention mask [B, 1, Q, K + Q] (or None)")
        text = self.text
        h = text.embed_tokens(input_ids)
        if canvas_from is not None:
            canvas = position_ids >= canvas_from.to(position_ids.device)[:, None]
            if bool(canvas.any()):
                signal = torch.zeros_like(h) if soft is None else soft.to(h.dtype)
                mixed = self.canvas_part.self_conditioning(h, signal)
                h = torch.where(canvas[..., None], mixed, h)
            canvas_from = canvas_from.to(position_ids.device)
        masks = self._masks(attention_mask, position_ids, canvas_from, key_positions, q)
        rope = {t: text.rotary_emb(h, position_ids, t) for t in set(self.layer_types)}
        for i, layer in enumerate(text.layers[: len(self.layer_types)]):
            kind = self.layer_types[i]
            h = layer(
                h, position_embeddings=rope[kind], attention_mask=masks[kind], position_ids=position_ids, cache=cache
            )
        h = text.norm(h)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.hf.lm_head(h).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return CausalLMOutputWithPast(logits=logits)  # the cache is the caller's, written in place


def _generation_defaults(folder: Path) -> dict:
    """The renoise decoder's settings from the folder's generation_config.json (where the checkpoint sets them)."""
    from dlm.fsutil import read_json_file

    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    fields = read_json_file(path, "generation config")
    out = {new: fields[old] for old, new in GENERATION_FIELDS.items() if fields.get(old) is not None}
    sampler = fields.get("sampler_config")
    if isinstance(sampler, dict) and sampler.get("entropy_bound") is not None:
        out["entropy_bound"] = float(sampler["entropy_bound"])
    return out


def load(folder: str | Path, dtype=None, device=None):
    """A :class:`~dlm.model.convert.DiffusionLM` of objective ``renoise`` from a DiffusionGemma folder."""
    from transformers import AutoTokenizer, DiffusionGemmaForBlockDiffusion

    folder = Path(folder)
    try:
        hf = DiffusionGemmaForBlockDiffusion.from_pretrained(
            folder, dtype=dtype or torch.float32, attn_implementation="sdpa"
        )
    except (OSError, ValueError, RuntimeError) as e:
        raise DLMError(f"could not load the DiffusionGemma checkpoint in '{folder}': {e}") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except Exception:  # noqa: BLE001 - a folder without a tokenizer still decodes token ids
        tokenizer = None
    return wrap(hf, tokenizer, _generation_defaults(folder), device=device)


def wrap(hf: nn.Module, tokenizer=None, sampler: dict | None = None, device=None):
    """A :class:`DiffusionLM` around a ``DiffusionGemmaForBlockDiffusion`` object (``sampler``: the renoise decoder's
    defaults of this checkpoint, e.g. from its generation_config.json)."""
    from dlm.model.convert import DiffusionLM, DLMSpec

    config = hf.config
    config.dlm_family = MODEL_TYPE
    config.dlm_attention = "renoise"
    config.dlm_sampler = {"renoise": dict(sampler or {})}
    text = _text_config(config)
    spec = DLMSpec(objective="renoise", mask_token_id=None, shift=False, block_size=int(config.canvas_length))
    dlm = DiffusionLM(RenoiseLM(hf), tokenizer, spec)
    # the text model's sizes and stop token where dlm reads them (the top-level config of the family has none)
    for name in ("vocab_size", "max_position_embeddings", "eos_token_id"):
        if getattr(config, name, None) is None:
            setattr(config, name, getattr(text, name))
    if device is not None:
        dlm.to(device)
    dlm.eval()
    return dlm
