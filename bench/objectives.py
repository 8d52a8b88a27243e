"""Forward+backward time of every training objective vs a plain AR training step, on the same tokens, same run.

    python bench/objectives.py                       # smollm2-135m, L = 256 and 512, 3 timed reps
    python bench/objectives.py --lengths 128 --reps 2 --model ./some-hf-folder --json out.json
    python bench/objectives.py --device cuda --batch-size 8 --lengths 512,2048 --bf16 --attn-impl flex_attention

Rows: ``ar`` (plain next-token CE, all weights trainable: the baseline), ``mdm`` (L tokens), ``block`` and
``idlm`` ([x_t | x0]: 2L tokens, all weights trainable; idlm by default on the split path: a causal clean pass
whose KV the L noisy tokens attend), ``idlm-2L`` (the same loss and gradients as one 2L forward with a dense
mask), ``idlm-gated`` (gated LoRA r=16 on all linear layers: clean pass once under no_grad + L mask tokens
attending its KV cache). ``ratio`` = step time / AR step time; ``build %`` = share of the step spent building
attention masks and noise (goal < 5%); the [x_t | x0] objectives process 2L tokens, so about 2x is the floor
(goal <= 2.3x). Times are medians over interleaved reps (on CUDA, synchronised before each clock read).
``--attn-impl flex_attention`` hands every objective a flex ``BlockMask`` instead of a dense mask;
``--random-init`` builds the model from its config with random weights (same shapes and cost: for machines that
hold the config and tokenizer but not the weights).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", default="256,512")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--block-size", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--attn-impl", default="sdpa", choices=["sdpa", "flex_attention"])
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 master weights), as training on GPU")
    p.add_argument("--random-init", action="store_true", help="random weights from the model's config")
    p.add_argument(
        "--shape",
        default="base",
        help="with --random-init: the model's own shape (base) or a larger body on its vocabulary: 0.5b, 1b "
        "(bench/shapes.py)",
    )
    p.add_argument("--json", help="also write the rows as JSON here")
    args = p.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from dlm.model.convert import convert_ar_to_dlm
    from dlm.model.hub import resolve_model_path
    from dlm.model.lora import prepare_model_for_lora
    from dlm.objectives import get_objective

    torch.manual_seed(0)
    folder = resolve_model_path(args.model)
    if args.shape != "base" and not args.random_init:
        p.error("--shape needs --random-init (a shape's weights exist only as random ones)")
    if args.random_init:
        from shapes import shaped_config
        from transformers import AutoModelForCausalLM, AutoTokenizer

        config = shaped_config(folder, args.shape)
        tokenizer = AutoTokenizer.from_pretrained(folder)

        def source():
            return AutoModelForCausalLM.from_config(
                copy.deepcopy(config), attn_implementation="sdpa", dtype=torch.float32
            )

        def convert(objective, **kw):
            return convert_ar_to_dlm(source(), objective, tokenizer=tokenizer, **kw)
    else:

        def convert(objective, **kw):
            return convert_ar_to_dlm(folder, objective, **kw)

    models = {
        "ar": convert("idlm", block_size=args.block_size),  # weights = the AR model
        "mdm": convert("mdm"),
        "block": convert("block", block_size=args.block_size),
        "idlm": convert("idlm", block_size=args.block_size),
        "idlm-2L": convert("idlm", block_size=args.block_size),
        "idlm-gated": prepare_model_for_lora(
            convert("idlm", block_size=args.block_size), {"r": 16, "alpha": 32, "gated": True}
        ),
    }
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    for _name, m in models.items():
        m.to(device)
        if args.attn_impl != "sdpa":
            m.base_model_hf.set_attn_implementation(args.attn_impl)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16 else __import__("contextlib").nullcontext()
    )
    objectives = {
        "mdm": get_objective("mdm", attention="annealed", anneal_steps=1000),
        "block": get_objective("block"),
        "idlm": get_objective("idlm"),  # split path: causal clean pass (kept graph) + L noisy queries on its KV
        "idlm-2L": get_objective("idlm", fast_path=False),  # the reference shape: one 2L forward, dense mask
        "idlm-gated": get_objective("idlm"),
    }
    for m in models.values():
        m.train()
    vocab = models["ar"].tokenizer.vocab_size
    gen = torch.Generator(device=device).manual_seed(0)

    def ar_step(model, batch):
        ids = batch["input_ids"]
        with autocast:
            logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
        loss.backward()
        return 0.0

    def obj_step(name):
        def step(model, batch):
            with autocast:
                out = objectives[name](model, batch, step=10, generator=gen)
            out.loss.backward()
            return out.parts.get("build_s", 0.0)

        return step

    steps = {"ar": ar_step, **{n: obj_step(n) for n in objectives}}
    rows = []
    where = torch.cuda.get_device_name(device) if cuda else f"cpu threads={torch.get_num_threads()}"
    print(
        f"model={args.model}{f' (random init, shape {args.shape})' if args.random_init else ''} {where} reps={args.reps} "
        f"block_size={args.block_size} batch={args.batch_size} attn={args.attn_impl} bf16={args.bf16}"
    )
    for L in [int(x) for x in args.lengths.split(",")]:
        ids = torch.randint(0, vocab, (args.batch_size, L), generator=torch.Generator().manual_seed(L)).to(device)
        batch = {"input_ids": ids, "labels": ids.clone()}
        times = {n: [] for n in steps}
        builds = {n: [] for n in steps}
        for rep in range(args.reps + 1):  # rep 0 = warm-up
            for name, fn in steps.items():
                model = models[name]
                for q in model.parameters():
                    q.grad = None
                sync()
                t0 = time.perf_counter()
                b = fn(model, batch)
                sync()
                dt = time.perf_counter() - t0
                if rep > 0:
                    times[name].append(dt)
                    builds[name].append(b)
        base = statistics.median(times["ar"])
        for name in steps:
            t = statistics.median(times[name])
            rows.append(
                {
                    "objective": name,
                    "L": L,
                    "batch": args.batch_size,
                    "attn": args.attn_impl,
                    "device": str(device),
                    "ms": 1000 * t,
                    "ratio": t / base,
                    "build_pct": 100 * statistics.median(builds[name]) / t,
                }
            )
    print(f"{'objective':<12} {'L':>5} {'ms/step':>9} {'ratio':>7} {'build %':>8}")
    for r in rows:
        print(f"{r['objective']:<12} {r['L']:>5} {r['ms']:>9.0f} {r['ratio']:>6.2f}x {r['build_pct']:>7.2f}%")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
