"""Introspective diffusion (I-DLM) training, docs/algorithms.md#idlm.

Alignment (the part that is easy to get wrong by one). Targets are shifted: position i is trained on token i+1.
A position is a **mask** in ``x_t`` exactly when its target is trained (``labels[i+1] != -100``, same document):
the mask at i has seen clean tokens of earlier blocks (up to i-1 for b = 1) and the masks of its own block up to
itself, and is trained on token i+1 - the same target as clean position i. So the mask at the last prompt
position predicts the first response token (the reference never scores that token in the noisy term), and the
number of masks equals the number of trained response tokens.

Loss: ``CE_noisy`` (mask positions vs the shifted targets, summed / number of response tokens) +
``ce_alpha * CE_clean`` (ordinary next-token CE of the clean half), or with ``loss_auto_balance``
``CE_noisy + sg(CE_noisy / (CE_clean + 1e-8)) * CE_clean``. ``idlm_loss_type='distill'`` trains the masks on the
clean pass's soft next-token distribution (the model's own AR distribution at the same position, detached)
instead of the hard label: self-distillation, which is what maximises ISD acceptance.

Batch size > 1, padded rows and packed rows (``doc_ids``) are handled by masks and per-document positions (the
reference slices the clean half as ``[:, L:2L]`` and so needs batch size 1).

Split (fast) path, the default: the clean half never attends to the noisy half, so it runs first as a plain
causal forward that fills a KV cache, and the L noisy tokens then attend to that cache with the
``introspective_cached`` L x 2L mask - the same maths as the 2L forward with the ``introspective`` mask, but the
clean half gets the model's own causal attention (no dense mask when rows are neither padded nor packed) and the
noisy queries skip the prompt blocks (the noisy pass starts at the first block holding a mask). Without gated
LoRA the clean pass keeps its graph and gradients reach it from both losses through the cached keys/values. With
gated LoRA the clean path is the frozen base model, so the clean pass runs under ``no_grad`` and only ``CE_noisy``
carries gradient (``CE_clean`` is logged, constant). ``fast_path: false`` forces the single 2L forward (tests
check both give the same loss and gradients).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from dlm.errors import DLMError
from dlm.model import masks
from dlm.model.convert import cache_kw
from dlm.model.lora import get_gated
from dlm.objectives.base import IGNORE, Objective, ObjectiveOutput, upcast, zero_loss
from dlm.objectives.configs import IDLMConfig


def build_noisy(input_ids: torch.Tensor, targets: torch.Tensor, mask_token_id: int):
    """``(x_t, noisy)``: every position whose shifted target is trained becomes a mask."""
    noisy = targets != IGNORE
    return torch.where(noisy, torch.full_like(input_ids, mask_token_id), input_ids), noisy


def _select(logits: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """``logits[where]`` as [n, V]; a free view (and a cheap backward) when every position is selected."""
    if bool(where.all()):
        return logits.reshape(-1, logits.shape[-1])
    return logits[where]


class IDLMObjective(Objective):
    name = "idlm"
    Config = IDLMConfig

    def __call__(self, model, batch, step: int = 0, generator=None) -> ObjectiveOutput:
        c = self.config
        b, t_build, _ = self.start(model, batch)
        B, L = b.shape
        if not model.shift:
            raise DLMError(
                "objective 'idlm' needs a shifted checkpoint (config.json shift: true); re-convert "
                "with `dlm convert --objective idlm`"
            )
        bs = self.resolve_block_size(model, c.block_size)
        targets = b.shifted_targets()  # [B, L]
        x_t, noisy = build_noisy(b.input_ids, targets, model.mask_token_id)
        n = int(noisy.sum())
        gated = get_gated(model) is not None
        fast = True if c.fast_path is None else bool(c.fast_path)
        hf = getattr(model, "base_model_hf", None)
        ckpt = getattr(hf, "is_activation_checkpointing", None)  # transformers 5 name; 4.x: is_gradient_checkpointing
        if ckpt is None:
            ckpt = getattr(hf, "is_gradient_checkpointing", False)
        if fast and ckpt and getattr(model, "training", True):
            # HF turns the KV cache off under gradient checkpointing, and the split path needs it: one 2L forward
            fast = False
        dev = model.device
        pos = b.positions
        if fast:
            # (prepare_batch already drops an all-valid attention mask)
            plain = b.key_valid is None and (b.doc_ids is None or bool((b.doc_ids == b.doc_ids[:, :1]).all()))
            # neither padded nor packed: the model's own causal attention (no dense mask, the fastest kernels)
            clean_attn = None if plain else self.attn_mask(model, masks.causal(b.doc_ids, b.key_valid), B, L)
            # Noisy queries before the first block holding a mask are never attended by a mask (masks see noisy
            # keys of their own block only), so the noisy pass starts there: prompts cost nothing twice.
            start = 0
            if n > 0:
                rows = noisy.any(1)
                first = noisy.float().argmax(1)  # first mask index per row
                block_start = first - pos.gather(1, first[:, None]).squeeze(1) % bs
                start = int(block_start[rows].min())
            noisy_mod = masks.introspective_cached(L, bs, b.doc_ids, b.key_valid, device=dev)
            noisy_attn = self.attn_mask(model, masks.rows_from(noisy_mod, L, start), B, L - start, 2 * L - start)
            build_s = time.perf_counter() - t_build
            kv = {cache_kw(model): DynamicCache()}  # filled by the clean pass, read by the noisy one
            with torch.no_grad() if gated else contextlib.nullcontext():
                out = model(input_ids=b.input_ids, attention_mask=clean_attn, position_ids=pos, use_cache=True, **kv)
            clean_logits = out.logits
            sub = model(
                input_ids=x_t[:, start:], attention_mask=noisy_attn, position_ids=pos[:, start:], use_cache=False, **kv
            ).logits
            noisy_logits, noisy_sel = sub, noisy[:, start:]  # all masks are at >= start
        else:
            attn = self.attn_mask(model, masks.introspective(L, bs, b.doc_ids, b.key_valid, device=dev), B, 2 * L)
            build_s = time.perf_counter() - t_build
            logits = model(
                input_ids=torch.cat([x_t, b.input_ids], 1), attention_mask=attn, position_ids=pos.repeat(1, 2)
            ).logits
            noisy_logits, clean_logits = logits[:, :L], logits[:, L:]
            noisy_sel = noisy
        if n == 0:
            z = zero_loss(noisy_logits)
            return ObjectiveOutput(loss=z, parts={"ce_noisy": 0.0, "ce_clean": 0.0, "build_s": build_s}, num_tokens=0)

        sel_clean = _select(clean_logits, noisy)  # [n, V]: every trained target
        sel_noisy = upcast(_select(noisy_logits, noisy_sel))  # [n, V], same order as sel_clean
        tgt = targets[noisy]
        ce_clean = F.cross_entropy(upcast(sel_clean), tgt)
        ce_noisy_hard = F.cross_entropy(sel_noisy, tgt, reduction="sum") / n
        parts = {}
        if c.idlm_loss_type == "distill":
            with torch.no_grad():
                soft = F.softmax(upcast(sel_clean.detach()) / c.distill_temperature, dim=-1)
            logq = F.log_softmax(sel_noisy / c.distill_temperature, dim=-1)
            ce_noisy = -(soft * logq).sum(-1).sum() / n
            with torch.no_grad():
                ent = -(soft * soft.clamp_min(1e-30).log()).sum(-1).sum() / n
            parts["kl_noisy"] = float(ce_noisy.detach() - ent)
        else:
            ce_noisy = ce_noisy_hard
        if c.loss_auto_balance:
            scale = (ce_noisy / (ce_clean + 1e-8)).detach()
        else:
            scale = torch.tensor(c.ce_alpha, device=dev)
        loss = ce_noisy + scale * (ce_clean.detach() if fast and gated else ce_clean)
        with torch.no_grad():
            guess = sel_noisy.argmax(-1)
            agree = (guess == sel_clean.argmax(-1)).float().mean()
            acc = (guess == tgt).float().mean()
        parts.update(
            {
                "ce_noisy": float(ce_noisy.detach()),
                "ce_noisy_hard": float(ce_noisy_hard.detach()),
                "ce_clean": float(ce_clean.detach()),
                "scale": float(scale),
                "mask_greedy_agree": float(agree),
                "mask_acc": float(acc),
                "build_s": build_s,
            }
        )
        return ObjectiveOutput(loss=loss, parts=parts, num_tokens=n)
