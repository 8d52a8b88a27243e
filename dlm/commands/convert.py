"""Turn a Hugging Face causal LM into a diffusion LM folder.

    dlm convert --model smollm2-135m --objective idlm --block-size 2 --output out/smollm2-idlm
    dlm convert --model ./my-llama --objective mdm --output out/llama-mdm
    dlm convert --model smollm2-135m --objective idlm --lora-r 16 --gated-lora --output out/smollm2-idlm-gated
    dlm convert --model smollm2-135m --objective idlm --block-size 2 --layers 4 --output out/drafter-l4
    dlm convert --model smollm2-135m --objective renoise --block-size 32 --output out/smollm2-renoise

The weights are untouched (under a causal mask the result returns the original logits); the folder gets a mask
token (the tokenizer's own, or a new special token with a resized embedding) and the DLM fields in config.json
(dlm_objective, block_size, mask_token_id, shift). Plain transformers.AutoModelForCausalLM still opens it.
With --gated-lora (I-DLM), zero-initialised mask-only adapters of rank --lora-r are written to
dlm_adapter.safetensors beside the untouched base weights, ready for `dlm train`. (Plain LoRA is attached by
`dlm train`; freshly initialised plain adapters are zero and would merge into nothing here.)
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, help="hub id (org/name), local Hugging Face folder or alias (e.g. smollm2-135m)"
    )
    p.add_argument(
        "--objective", required=True, help="mdm | block | idlm | renoise (uniform-noise, DiffusionGemma's kind)"
    )
    p.add_argument("--block-size", type=int, help="masks per block (block: default 4, idlm: default 1)")
    p.add_argument(
        "--shift",
        dest="shift",
        action="store_true",
        default=None,
        help="hidden state i predicts token i+1 (default for mdm and idlm)",
    )
    p.add_argument("--no-shift", dest="shift", action="store_false", help="no shift (default for block/SDAR)")
    p.add_argument("--mask-token", help="mask token text (default: the tokenizer's own, else <|mdm_mask|>)")
    p.add_argument("--lora-r", type=int, help="rank of the --gated-lora adapters (default 16)")
    p.add_argument("--lora-alpha", type=int, help="LoRA alpha (default 2 x r)")
    p.add_argument(
        "--lora-targets",
        default="all-linear",
        help="comma-separated module names (e.g. q_proj,v_proj) or all-linear (default)",
    )
    p.add_argument(
        "--gated-lora",
        action="store_true",
        help="adapters act only at mask positions: the clean path stays the base model exactly",
    )
    p.add_argument(
        "--layers",
        type=int,
        metavar="L",
        help="keep only the model's first L layers (+ embedding, final norm, head): the start of a small "
        "drafter for it (idlm; mask token: the tokenizer's own or a spare special token, so the "
        "vocabulary stays the model's); train it on the model's greedy answers (docs/vllm.md)",
    )
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (weights as saved)")
    p.add_argument("--output", required=True, help="output folder (written atomically)")
    p.add_argument("--force", action="store_true", help="replace an existing --output folder")
    p.add_argument("--quiet", action="store_true", help="no progress bar (shown only when stderr is a terminal)")


def run(args) -> int:
    from pathlib import Path

    from dlm.device import get_dtype
    from dlm.errors import DLMError
    from dlm.model.convert import check_objective, convert_ar_to_dlm
    from dlm.progress import bar as progress_bar
    from dlm.progress import wanted

    check_objective(args.objective)
    out = Path(args.output)
    if out.exists() and not args.force:
        raise DLMError(f"--output '{out}' already exists; choose another folder or pass --force")
    lora = None
    if args.gated_lora and args.lora_r is None:
        args.lora_r = 16
    if args.lora_r is not None:
        lora = {
            "r": args.lora_r,
            "alpha": args.lora_alpha or 2 * args.lora_r,
            "target_modules": args.lora_targets,
            "gated": bool(args.gated_lora),
        }
        if args.gated_lora and args.objective != "idlm":
            raise DLMError("--gated-lora is the I-DLM lossless mode; use it with --objective idlm")
        if not args.gated_lora:
            raise DLMError(
                "--lora-r without --gated-lora: plain LoRA adapters start at zero and merge into "
                "nothing on save; add --gated-lora, or set the lora section of `dlm train`"
            )
    elif args.lora_alpha is not None:
        raise DLMError("--lora-alpha needs --lora-r or --gated-lora")
    if args.layers is not None and (args.objective != "idlm" or lora is not None or args.shift is False):
        raise DLMError("--layers cuts a drafter: use it with --objective idlm, without adapters or --no-shift")
    dtype = get_dtype(args.dtype, __import__("torch").device("cpu"))
    bar = progress_bar(2, f"convert: loading {args.model}", "stage") if wanted(args.quiet) else None
    try:
        if args.layers is not None:
            from dlm.model.drafter import truncated_drafter

            dlm = truncated_drafter(
                args.model, args.layers, block_size=args.block_size or 1, mask_token=args.mask_token, dtype=dtype
            )
        else:
            dlm = convert_ar_to_dlm(
                args.model,
                args.objective,
                block_size=args.block_size,
                shift=args.shift,
                mask_token=args.mask_token,
                lora=lora,
                dtype=dtype,
            )
        if bar is not None:
            bar.update(1)
            bar.set_description(f"convert: writing {out}")
        dlm.save_pretrained(out)
        if bar is not None:
            bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    spec = dlm.spec
    extra = ""
    if lora is not None:
        extra = f", gated LoRA r={lora['r']} on {len(dlm.gated_lora.adapters)} layers"
    if spec.mask_token_id is None:  # uniform noise (renoise): no mask token
        mask = "no mask token (uniform noise), a self-conditioning block beside the weights"
    else:
        mask = f"mask_token_id={spec.mask_token_id} ({dlm.tokenizer.convert_ids_to_tokens(spec.mask_token_id)})"
    print(f"wrote {out}: objective={spec.objective} block_size={spec.block_size} shift={spec.shift} {mask}{extra}")
    return 0
