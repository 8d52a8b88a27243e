"""DiffusionGemma (uniform-noise "renoising" block diffusion on the Gemma 4 backbone) as a dlm model.

transformers defines the family itself (``DiffusionGemmaForBlockDiffusion``, model_type ``diffusion_gemma``): a
causal *encoder* writes the KV cache of the prompt and of every committed canvas, and a bidirectional *decoder*
reads it while it denoises the next canvas of ``canvas_length`` tokens. The two share every weight of their
layers, their final norm and the embeddings (the checkpoint ties them); the decoder alone has the
self-conditioning block, which mixes the soft embedding of the previous step's prediction into the canvas's input
embeddings. Each layer is a dense gated MLP plus a routed mixture of experts, with sliding-window and full
attention layers.

dlm loads the folder with transformers' own class (no remote code, no renamed weights) and runs it through
:class:`DiffusionGemmaLM`: one forward over the engine's usual chunk - tokens to encode (causal, their KV kept) followed
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
from dlm.fsutil import read_json_file
from dlm.model.convert import DiffusionLM, DLMSpec
from dlm.model.families.base import Family
from dlm.model.renoise import RenoiseLM, unwrapped

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


class DiffusionGemmaLM(RenoiseLM):
    """A ``DiffusionGemmaForBlockDiffusion`` run as one forward over [context | canvas] (module doc and
    :class:`~dlm.model.renoise.RenoiseLM`). A context token's logits are the encoder's hidden state through the
    shared head (the encoder's causal language-model scores)."""

    def __init__(self, hf: nn.Module):
        super().__init__(hf)
        text = _text_config(self.config)
        self.window = getattr(text, "sliding_window", None)
        self.layer_types = list(text.layer_types)
        self.softcap = getattr(text, "final_logit_softcapping", None)

    # the parts (transformers ties the encoder's text layers, norm and embeddings to the decoder's)
    @property
    def text(self) -> nn.Module:
        return unwrapped(self.hf).model.encoder.language_model

    def get_input_embeddings(self):
        return self.text.embed_tokens

    @property
    def mixer(self) -> nn.Module:
        return unwrapped(self.hf).model.decoder.self_conditioning

    def save_folder(self, hf: nn.Module, folder: Path) -> None:
        """A DiffusionGemma folder as transformers writes it (dlm's own fields left out: the family is recognised by
        its model_type), which transformers, vLLM and SGLang load as they load the published one."""
        config = hf.config
        added = ("mask_token_id", "shift", "block_size", *getattr(config, "dlm_copied", ()))  # set by wrap()
        ours = {k: v for k, v in vars(config).items() if k.startswith("dlm_") or k in added}
        for k in ours:
            delattr(config, k)
        try:
            hf.save_pretrained(folder)
        finally:
            for k, v in ours.items():
                setattr(config, k, v)

    def body(self, h, masks, pos, cache):
        text = self.text
        rope = {t: text.rotary_emb(h, pos, t) for t in set(self.layer_types)}
        for i, layer in enumerate(text.layers[: len(self.layer_types)]):
            kind = self.layer_types[i]
            h = layer(h, position_embeddings=rope[kind], attention_mask=masks[kind], position_ids=pos, cache=cache)
        return text.norm(h)


def _generation_defaults(folder: Path) -> dict:
    """The renoise decoder's settings from the folder's generation_config.json (where the checkpoint sets them)."""

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

    config = hf.config
    config.dlm_family = MODEL_TYPE
    config.dlm_attention = "renoise"
    config.dlm_sampler = {"renoise": dict(sampler or {})}
    text = _text_config(config)
    spec = DLMSpec(objective="renoise", mask_token_id=None, shift=False, block_size=int(config.canvas_length))
    dlm = DiffusionLM(DiffusionGemmaLM(hf), tokenizer, spec)
    # the text model's sizes and stop token where dlm reads them (the top-level config of the family has none)
    copied = [n for n in ("vocab_size", "max_position_embeddings", "eos_token_id") if getattr(config, n, None) is None]
    for name in copied:
        setattr(config, name, getattr(text, name))
    config.dlm_copied = copied  # left out again when the folder is saved
    if device is not None:
        dlm.to(device)
    dlm.eval()
    return dlm


FAMILY = Family(
    name=MODEL_TYPE,
    title=TITLE,
    objective="renoise",
    shift=False,
    attention="renoise",  # causal context, bidirectional canvas (DiffusionGemmaLM)
    recognise=is_diffusion_gemma,
    load=load,
    export=("diffusion_gemma", "dlm.model.export:to_diffusion_gemma"),
)
