"""Write a dlm model in the layout of a published diffusion LM family, for the engines that serve that family.

  dlm export --model runs/qwen3-block --format sdar --output out/sdar
  dlm export --model runs/llama-mdm --format llada --output out/llada
  dlm export --model runs/qwen2-mdm --format dream --output out/dream
  dlm export --model runs/quickstart/train_b2 --format vllm --output out/vllm-target
  dlm export --model runs/quickstart/train_b2 --drafter --target smollm2-135m --output out/drafter

sdar: Qwen3 block-diffusion models (no shift) and I-DLMs; llada: bias-free Llama mdm models without shift; dream:
Qwen2 (or Llama) mdm models with shift. The folder loads back with `dlm.load_model` (identical logits); which
engine reads which format: docs/models.md. vllm: the folder vLLM serves as the model means it (a gated-LoRA
I-DLM without its adapter file: its clean path, the base model). --drafter: an I-DLM as a vLLM parallel drafter
(adapters merged, mask token in the target's vocabulary, K = block size + 1 in config.json; docs/vllm.md).
"""

from __future__ import annotations

import argparse

# --format name -> its help; dlm.model.export holds the layouts
FORMATS = {
    "sdar": "SDAR / I-DLM layout (Qwen3 weights, block_size and mask_token_id in config.json)",
    "llada": "LLaDA layout (model.transformer.* names, LLaDA config fields)",
    "dream": "Dream layout (Qwen2 weights, mask_token_id, generation_config.json)",
    "llada2": "LLaDA2 layout (a loaded LLaDA2: fused query_key_value, experts one by one, block_size, mask_token_id)",
    "diffusion_gemma": "DiffusionGemma layout (a loaded DiffusionGemma, fine-tuned or not: transformers' own folder)",
    "vllm": "the folder vLLM serves as this model (a gated-LoRA I-DLM: its base model, without the adapter file)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a dlm model folder (or a published checkpoint folder)")
    p.add_argument("--format", choices=sorted(FORMATS), help="; ".join(f"{k}: {v}" for k, v in FORMATS.items()))
    p.add_argument(
        "--drafter", action="store_true", help="export an I-DLM as a vLLM parallel drafter (instead of --format)"
    )
    p.add_argument(
        "--target",
        help="--drafter: the model it drafts for (its vocabulary is matched; default: the I-DLM's own clean path)",
    )
    p.add_argument("--output", required=True, help="output folder (written under a temporary name, then renamed)")
    p.add_argument("--force", action="store_true", help="replace an existing --output folder")


def export_layout(args) -> None:
    from dlm.errors import DLMError
    from dlm.model.convert import load_any
    from dlm.model.export import export_model
    from dlm.model.families import inspect_folder
    from dlm.model.hub import resolve_model_path

    folder = resolve_model_path(args.model)
    if not inspect_folder(folder).is_dlm:
        raise DLMError(
            f"--model '{args.model}' is a plain causal LM, not a DLM; convert it first (dlm convert "
            f"--objective mdm|block|idlm|renoise) and export that folder"
        )
    dlm = load_any(folder)
    export_model(dlm, args.output, args.format)
    spec = dlm.spec
    print(
        f"wrote {args.output}: {args.format} layout, objective={spec.objective} block_size={spec.block_size} "
        f"shift={spec.shift} mask_token_id={spec.mask_token_id}"
    )


def export_vllm(args) -> None:
    from dlm.serve.vllm import export_vllm_folder

    print(f"wrote {export_vllm_folder(args.model, args.output, force=args.force)}: the folder vLLM serves")


def export_drafter(args) -> None:
    from dlm.model.drafter import export_drafter as write

    info = write(args.model, args.output, target=args.target, force=args.force)
    print(
        f"wrote {args.output}: vLLM parallel drafter, num_speculative_tokens={info['num_speculative_tokens']} "
        f"mask_token_id={info['mask_token_id']} vocab={info['target_vocab_size']}"
        + (" (gated adapters merged)" if info["gated_adapters_merged"] else "")
    )


# --format -> writer; every format of dlm.model.export goes through export_layout
WRITERS = {name: export_layout for name in FORMATS}
WRITERS["vllm"] = export_vllm


def run(args) -> int:
    from pathlib import Path

    from dlm.errors import DLMError

    out = Path(args.output)
    if out.exists() and not args.force:
        raise DLMError(f"--output '{out}' already exists; choose another folder or pass --force")
    if args.drafter:
        if args.format is not None:
            raise DLMError("--drafter writes its own layout; drop --format")
        export_drafter(args)
        return 0
    if args.format is None:
        raise DLMError(f"give --format ({', '.join(sorted(FORMATS))}) or --drafter")
    if args.target is not None:
        raise DLMError("--target goes with --drafter")
    WRITERS[args.format](args)
    return 0
