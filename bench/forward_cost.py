"""What one decode forward costs by chunk shape: why ISD's tokens per forward do (or do not) turn into speed.

    python bench/forward_cost.py                          # smollm2-135m converted to an I-DLM, random adapters
    python bench/forward_cost.py --model runs/quickstart/train_b2   # a trained gated-LoRA checkpoint
    python bench/forward_cost.py --device cuda --dtype bf16 --batch-size 1,32 --random-init

Times a KV-cache extend (cache of ``--context`` tokens, at each ``--batch-size``) for the chunks the engine
feeds:

- ``ar``: 1 token (plain AR step);
- ``isd cold N``: ``[t, M x (N-1)]`` (N tokens, N-1 masks);
- ``isd verify N``: ``[c, d_1..d_{N-1}, M x (N-1)]`` (2N-1 tokens, N-1 masks);

each with the gated-LoRA adapters acting on the masks and, interleaved, with them idle (same tokens, base maths
only: what the extra tokens alone cost). Medians of interleaved repeats; ratios to the
1-token step of the same run. With acceptance a, greedy ISD at N = 2 makes 2 / (2 - a) tokens per forward, so it
beats AR in wall-clock only when that exceeds the verify/cold cost ratios below. ``--random-init`` builds the
model from its config (same shapes, same cost) for machines that hold the config but not the weights.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from dlm.decode import cpu as cpu_kernels


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        default="smollm2-135m",
        help="alias / AR folder (converted, random adapters) or a trained I-DLM checkpoint",
    )
    ap.add_argument("--strides", default="2,3,4")
    ap.add_argument("--context", type=int, default=128, help="tokens already in the KV cache")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--lora-r", type=int, default=32, help="rank of the random adapters when --model has none")
    ap.add_argument(
        "--targets",
        default="all-linear",
        help="modules of the random adapters when --model has none "
        "(comma-separated names, e.g. q_proj,v_proj; default all-linear)",
    )
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--batch-size", default="1", help="comma-separated batch sizes")
    ap.add_argument("--random-init", action="store_true", help="random weights from the model's config")
    ap.add_argument(
        "--shape",
        default="base",
        help="with --random-init: the model's own shape (base) or a larger body on its vocabulary: 0.5b, 1b "
        "(bench/shapes.py)",
    )
    ap.add_argument(
        "--candidates",
        default="",
        help="comma-separated K: also time ISD N=2 verify chunks with K draft candidates "
        "([c, d^1..d^K, M^1..M^K, F]: 2K+2 tokens, K+1 masks)",
    )
    ap.add_argument(
        "--linear",
        default="kernel,blas",
        help="comma-separated, interleaved per repeat: kernel (the engine's few-row CPU kernel, "
        "dlm.decode.cpu; fp32 CPU only) and/or blas (torch's F.linear)",
    )
    ap.add_argument(
        "--cache",
        default="dynamic",
        choices=["dynamic", "engine"],
        help="dynamic: transformers' DynamicCache (the kernels' layer-by-layer path); engine: the engine's growing "
        "cache, on which a chunk whose layers all take their two kernel calls is one decode_stack call",
    )
    ap.add_argument(
        "--attn",
        default="dlm_sdpa",
        help="comma-separated, interleaved per repeat: dlm_sdpa (the engine's attention: no KV copy for "
        "masked grouped-query chunks) and/or sdpa (transformers')",
    )
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")

    from transformers import DynamicCache

    from dlm.model.convert import cache_kw, load_any
    from dlm.model.hub import resolve_model_path
    from dlm.model.lora import get_gated

    if args.shape != "base" and not args.random_init:
        ap.error("--shape needs --random-init (a shape's weights exist only as random ones)")
    if args.random_init:
        from shapes import random_idlm

        dlm = random_idlm(resolve_model_path(args.model), args.shape)
    else:
        dlm = load_any(args.model, "idlm")
    if get_gated(dlm) is None:
        from shapes import random_gated_adapters

        random_gated_adapters(dlm, args.lora_r, args.targets)
    impls = [a for a in args.attn.split(",") if a]
    if any(a not in ("sdpa", "dlm_sdpa") for a in impls):
        ap.error(f"--attn takes sdpa and/or dlm_sdpa, got {args.attn!r}")
    if "dlm_sdpa" in impls:
        from dlm.decode.attention import register

        register()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dlm.to(device=device, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    lins = [x for x in args.linear.split(",") if x]
    if any(x not in ("kernel", "blas") for x in lins) or not lins:
        ap.error(f"--linear takes kernel and/or blas, got {args.linear!r}")
    if "kernel" in lins:
        from dlm.decode import cpu as cpu_kernels

        if not cpu_kernels.attach(dlm):
            print(
                "the CPU kernels do not apply here (not fp32 on CPU, DLM_CPU_KERNEL=0, no build, or slower "
                "than stock on this machine - DLM_CPU_KERNEL=1 forces them): blas only"
            )
            lins = ["blas"]
    args.lins = lins
    hf, m = dlm.model, dlm.mask_token_id
    kw = cache_kw(dlm)
    strides = [int(s) for s in args.strides.split(",") if s]
    g = torch.Generator().manual_seed(0)
    shapes = [("ar", 1, 0)]
    for n in strides:
        shapes += [(f"isd cold N={n}", n, n - 1), (f"isd verify N={n}", 2 * n - 1, n - 1)]
    shapes += [(f"isd N=2 K={k}", 2 * k + 2, k + 1) for k in (int(x) for x in args.candidates.split(",") if x)]
    where = torch.cuda.get_device_name(device) if cuda else f"{torch.get_num_threads()} threads"
    print(
        f"{len(dlm.gated_lora.adapters)} adapters; model {args.model}{f' (random init, shape {args.shape})' if args.random_init else ''}"
        f", {args.dtype}, {args.context} tokens in the {args.cache} cache, median of {args.repeats}, {where}"
    )
    for B in [int(x) for x in args.batch_size.split(",") if x]:
        bench_batch(args, B, hf, m, kw, shapes, g, device, cuda, dlm, DynamicCache, impls)
    return 0


def bench_batch(args, B, hf, m, kw, shapes, g, device, cuda, dlm, DynamicCache, impls) -> None:
    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    with torch.inference_mode():
        ctx = torch.randint(100, 20000, (B, args.context), generator=g).to(device)
        if args.cache == "engine":
            from dlm.decode.engine import KVBatch

            cache = KVBatch().cache
        else:
            cache = DynamicCache()
        hf(input_ids=ctx, use_cache=True, **{kw: cache})

        def one(t: int, masks: int, kernel: bool) -> float:
            ids = torch.randint(100, 20000, (B, t), generator=g)
            if masks:
                ids[:, t - masks :] = m
            ids = ids.to(device)
            pos = torch.arange(args.context, args.context + t, device=device)[None].expand(B, t)
            sync()
            t0 = time.perf_counter()
            with cpu_kernels.active(kernel):
                hf(input_ids=ids, position_ids=pos, use_cache=True, **{kw: cache})
            sync()
            dt = time.perf_counter() - t0
            cache.crop(-t)  # drop what this step appended
            return dt

        gated = dlm.gated_lora
        real_mask = gated.mask_token_id

        def measure() -> tuple[dict, dict]:
            """Interleaved: each repeat times every shape with the adapters on, then with them off (the gate set to
            match no token, so the same tokens run the bare base model's maths), under each attention
            implementation and linear kernel in turn, so machine noise hits all alike."""
            keys = [(a, lin, s) for a in impls for lin in args.lins for s in shapes]
            on, off = ({k: [] for k in keys} for _ in range(2))
            for a in impls:
                dlm.base_model_hf.set_attn_implementation(a)
                for lin in args.lins:
                    for s in shapes:
                        one(*s[1:], lin == "kernel")  # warm-up
            for _ in range(args.repeats):
                for a in impls:
                    dlm.base_model_hf.set_attn_implementation(a)
                    for lin in args.lins:
                        for s in shapes:
                            gated.mask_token_id = real_mask
                            on[(a, lin, s)].append(one(*s[1:], lin == "kernel"))
                            gated.mask_token_id = -1
                            off[(a, lin, s)].append(one(*s[1:], lin == "kernel"))
            gated.mask_token_id = real_mask
            med = lambda d: {k: statistics.median(v) * 1000 for k, v in d.items()}  # noqa: E731
            return med(on), med(off)

        with_adapters, bare = measure()

    # ratios are to the 1-token step of the last --linear (blas by default: the stock AR step)
    ref = {a: bare[(a, args.lins[-1], shapes[0])] for a in impls}
    for a in impls:
        for lin in args.lins:
            print(f"batch {B}, attention {a}, linear {lin} (x ar: to the bare 1-token step with {args.lins[-1]})")
            print(f"{'chunk':<16} {'tokens':>6} {'masks':>5} {'ms gated':>9} {'x ar':>6} {'ms bare':>8} {'x ar':>6}")
            for s in shapes:
                name, t, k = s
                on, off = with_adapters[(a, lin, s)], bare[(a, lin, s)]
                print(f"{name:<16} {t:>6} {k:>5} {on:>9.2f} {on / ref[a]:>6.2f} {off:>8.2f} {off / ref[a]:>6.2f}")
    if len(impls) > 1:
        a0, a1 = impls[0], impls[1]
        lin = args.lins[0]
        print(
            f"batch {B}: ms gated, {a1} / {a0}: "
            + ", ".join(f"{s[0]} {with_adapters[(a1, lin, s)] / with_adapters[(a0, lin, s)]:.2f}" for s in shapes)
        )


if __name__ == "__main__":
    raise SystemExit(main())
