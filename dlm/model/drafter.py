"""dlm I-DLMs as parallel drafters for another engine's exact speculative decoding (vLLM's ``draft_model`` method
with ``parallel_drafting``), and small drafters cut from a larger target.

A parallel drafter gets the context, the last committed token and K-1 mask tokens under a causal mask, and
proposes the K tokens predicted at the last K positions: the cold-start chunk of an I-DLM with ``shift=true``
(docs/algorithms.md#idlm), so an I-DLM trained with block size b drafts K = b + 1 tokens per forward exactly as
it was trained. The target verifies the drafts, so the served output is the target's whatever the drafter says.

:func:`export_drafter` writes such a drafter as a plain Hugging Face folder:

- gated-LoRA adapters (which act at mask positions only) are merged into the weights and the trained mask
  embedding written into the mask token's input row (a tied head gets its own copy, so the head rows stay the
  model's): the drafter then runs the adapters at every position, so its context and first draft come from
  weights it was not trained with - exact output still, but far fewer accepted drafts (docs/vllm.md); plain or
  merged-adapter checkpoints and small full drafters have no such gap;
- the vocabulary is made the target's: a mask token added by ``dlm convert`` (the row past the target's last
  token) moves to a special token of the target's tokenizer that chat text does not use (``<empty_output>`` for
  SmolLM2) and the extra rows are dropped, so vLLM accepts the pair without a heterogeneous-vocabulary mapping;
- ``config.json`` keeps ``mask_token_id`` (read by vLLM) and gets ``dlm_drafter``: the number of speculative
  tokens K, the block size it was trained with and the source folder.

:func:`truncated_drafter` makes the small drafter of a larger target: its first L layers with its embedding,
final norm and head, converted to an I-DLM with an in-vocabulary mask token; train it with ``dlm train`` on the
target's own greedy answers (``idlm_loss_type: ar``, ``ce_alpha: 1``: the clean path learns the target's next
token, the masks the ones after it) - :func:`dlm.train.drafter.train_small_drafter` does both.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dlm.errors import DLMError
from dlm.fsutil import atomic_folder
from dlm.model.convert import AutoDLMForCausalLM, convert_ar_to_dlm
from dlm.model.hub import load_tokenizer, resolve_model_path
from dlm.model.lora import get_gated
from dlm.settings import home

DRAFTER_KEY = "dlm_drafter"
# special tokens a chat never produces, tried in order as the drafter's in-vocabulary mask token
SPARE_MASK_TOKENS = ("<empty_output>", "<jupyter_script>", "<issue_closed>", "<|reserved_special_token_0|>", "<mask>")


def num_speculative_tokens(block_size: int | None) -> int:
    """K for an I-DLM trained with ``block_size`` masks: the last clean token's prediction plus one per mask."""
    if not isinstance(block_size, int) or block_size < 1:
        raise DLMError(f"a drafter needs an I-DLM with a positive block_size in config.json, got {block_size!r}")
    return block_size + 1


def spare_mask_token(tokenizer, vocab_size: int) -> int:
    """An id below ``vocab_size`` of a special token that chat text does not use, to carry the drafter's mask."""
    vocab = tokenizer.get_vocab()
    special = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    used = {tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id}
    for name in SPARE_MASK_TOKENS:
        tid = vocab.get(name)
        if tid is not None and tid < vocab_size and name in special and tid not in used:
            return int(tid)
    raise DLMError(
        f"the target's tokenizer has none of the spare special tokens {', '.join(SPARE_MASK_TOKENS)} "
        f"to carry the drafter's mask: convert the drafter with `dlm convert --mask-token TOKEN` naming "
        f"a special token of the target that chat text never contains"
    )


def target_vocab_size(target) -> int:
    """The vocabulary (embedding rows) of a target folder/alias."""

    folder = resolve_model_path(target)
    cfg = json.loads((folder / "config.json").read_text())
    size = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int):
        raise DLMError(f"'{folder}/config.json' has no vocab_size: cannot match the drafter's vocabulary to it")
    return size


def merged_drafter(src, target_vocab: int | None = None):
    """The Hugging Face model, tokenizer, mask id and K of the drafter exported from I-DLM folder ``src``."""

    dlm = AutoDLMForCausalLM.from_pretrained(src)
    if dlm.objective != "idlm":
        raise DLMError(
            f"'{src}' is a '{dlm.objective}' DLM; a parallel drafter must be a causal I-DLM "
            f"(dlm convert/train --objective idlm)"
        )
    if not dlm.shift:
        raise DLMError(
            f"'{src}' has shift=false; vLLM's parallel drafting reads the next token at each position "
            f"(shift=true, the I-DLM default)"
        )
    k = num_speculative_tokens(dlm.block_size)
    model, tok, mask_id = dlm.base_model_hf, dlm.tokenizer, dlm.mask_token_id
    gated = get_gated(dlm)
    with torch.no_grad():
        if gated is not None:
            modules = dict(model.named_modules())
            for name, adapter in zip(gated.module_names, gated.adapters.values()):
                lin = modules[name]
                delta = gated.scale * (adapter.B @ adapter.A)  # [out, in]
                if isinstance(lin, torch.nn.Linear):
                    lin.weight += delta.to(lin.weight.dtype)
                else:  # GPT-2 Conv1D keeps [in, out]
                    lin.weight += delta.T.to(lin.weight.dtype)
            mask_vec = gated.mask_embedding.detach().clone()
            gated.remove()
            dlm.gated_lora = None
        else:
            mask_vec = model.get_input_embeddings().weight[mask_id].clone()
        vocab = model.get_input_embeddings().weight.shape[0]
        target_vocab = target_vocab or vocab
        if vocab < target_vocab:
            model.resize_token_embeddings(target_vocab, mean_resizing=False)
            vocab = target_vocab
        if mask_id >= target_vocab:
            extra = vocab - target_vocab
            if extra > 1 or mask_id != target_vocab:
                raise DLMError(
                    f"the drafter has {extra} rows past the target's {target_vocab}-token vocabulary "
                    f"(only the mask row can be moved): drafter and target must share the tokenizer"
                )
            mask_id = spare_mask_token(tok, target_vocab)
            model.resize_token_embeddings(target_vocab, mean_resizing=False)
            tok.mask_token = tok.convert_ids_to_tokens(mask_id)
        elif vocab > target_vocab:
            raise DLMError(
                f"the drafter's vocabulary ({vocab}) is larger than the target's ({target_vocab}) beyond "
                f"its mask row; drafter and target must share the tokenizer"
            )
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        if head is not None and head.weight.data_ptr() == emb.weight.data_ptr():
            # tied: the mask's trained input vector must not become the head row of its token (the drafter would
            # then propose that token wherever the vector scores high), so the head gets its own copy
            head.weight = torch.nn.Parameter(emb.weight.detach().clone())
            model.config.tie_word_embeddings = False
            if hasattr(model.config, "get_text_config"):
                model.config.get_text_config().tie_word_embeddings = False
        emb.weight[mask_id] = mask_vec.to(emb.weight.dtype)
    cfg = model.config
    for key in ("dlm_gated_lora",):
        if hasattr(cfg, key):
            delattr(cfg, key)
    cfg.mask_token_id = int(mask_id)
    cfg.vocab_size = int(target_vocab)
    return model, tok, int(mask_id), k


def export_drafter(src, out, target=None, force: bool = False) -> dict:
    """Write I-DLM folder ``src`` as a vLLM parallel drafter to ``out`` (atomically); return its summary."""

    src_folder = resolve_model_path(src)
    fields = json.loads((src_folder / "config.json").read_text())
    if "dlm_objective" not in fields:
        raise DLMError(
            f"'{src_folder}' is a plain causal LM (no dlm_objective in config.json): a drafter is an "
            f"I-DLM; convert and train one (dlm convert --objective idlm, dlm train)"
        )
    out = Path(out)
    if out.exists() and not force:
        raise DLMError(f"--output '{out}' already exists; choose another folder or pass --force")
    tv = None
    if target is not None:
        tv = target_vocab_size(target)
        theirs, ours = load_tokenizer(target).get_vocab(), load_tokenizer(src_folder).get_vocab()
        # the ids both tokenizers have must mean the same text (a mask token one of them added past the shared
        # vocabulary is fine: the other never produces that id)
        common = min(len(theirs), len(ours))
        differ = [t for t, i in theirs.items() if i < common and ours.get(t) != i] + [
            t for t, i in ours.items() if i < common and theirs.get(t) != i
        ]
        if differ:
            raise DLMError(
                f"--target '{target}' and the drafter '{src_folder}' do not share the tokenizer "
                f"({len(differ)} tokens differ, e.g. {differ[0]!r}): a drafter proposes the target's "
                f"token ids, so it must be trained from the same tokenizer"
            )
    model, tok, mask_id, k = merged_drafter(src_folder, tv)
    info = {
        "num_speculative_tokens": k,
        "block_size": fields.get("block_size"),
        "mask_token_id": mask_id,
        "source": str(src_folder),
        "target_vocab_size": int(model.config.vocab_size),
        "gated_adapters_merged": "dlm_gated_lora" in fields,
    }
    setattr(model.config, DRAFTER_KEY, info)
    with atomic_folder(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return info


def drafter_info(folder) -> dict | None:
    """The ``dlm_drafter`` entry of an exported drafter folder, else None."""
    cfg = Path(folder) / "config.json"
    if not cfg.is_file():
        return None
    return json.loads(cfg.read_text()).get(DRAFTER_KEY)


def truncated_drafter(target, layers: int, block_size: int = 2, mask_token: str | None = None, dtype=None):
    """A DiffusionLM of ``target``'s first ``layers`` layers (+ its embedding, final norm, head), converted to an
    I-DLM with block size ``block_size`` and an in-vocabulary mask token (default: a spare special token)."""
    from transformers import AutoModelForCausalLM

    folder = resolve_model_path(target)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32, attn_implementation="sdpa")
    tok = load_tokenizer(folder)
    truncate_layers(model, layers)
    if mask_token is None and getattr(tok, "mask_token", None) is None:
        mask_token = tok.convert_ids_to_tokens(spare_mask_token(tok, model.get_input_embeddings().weight.shape[0]))
    return convert_ar_to_dlm(model, "idlm", block_size=block_size, mask_token=mask_token, tokenizer=tok)


def truncate_layers(model, layers: int) -> None:
    """Keep the first ``layers`` decoder layers of a Hugging Face causal LM (in place)."""
    total = model.config.num_hidden_layers
    if not isinstance(layers, int) or not 1 <= layers <= total:
        raise DLMError(f"--layers must be in 1..{total} (the target's layer count), got {layers!r}")
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    if not hasattr(inner, "layers"):
        raise DLMError(f"{type(model).__name__} keeps no `layers` list: cannot cut it to {layers} layers")
    inner.layers = inner.layers[:layers]
    model.config.num_hidden_layers = layers
    if isinstance(getattr(model.config, "layer_types", None), list):
        model.config.layer_types = model.config.layer_types[:layers]


def export_for_serving(src, cache_root: Path | None = None, target=None) -> Path:
    """An exported drafter folder for ``src``: ``src`` itself when it already is one, else an export cached under
    ``$DLM_HOME/vllm/drafters`` (keyed by the source's path and modification times)."""
    import hashlib

    folder = resolve_model_path(src)
    if drafter_info(folder) is not None:
        return folder
    stamp = "|".join(
        f"{p.name}:{p.stat().st_mtime_ns}:{p.stat().st_size}" for p in sorted(folder.iterdir()) if p.is_file()
    )
    key = hashlib.sha256(f"{folder.resolve()}|{target}|{stamp}".encode()).hexdigest()[:16]
    out = (cache_root or home() / "vllm" / "drafters") / f"{folder.name}-{key}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    export_drafter(folder, out, target=target, force=True)
    return out


__all__ = [
    "export_drafter",
    "export_for_serving",
    "drafter_info",
    "truncated_drafter",
    "num_speculative_tokens",
    "truncate_layers",
    "spare_mask_token",
    "DRAFTER_KEY",
]
