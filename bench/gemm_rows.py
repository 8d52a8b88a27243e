"""What one more row costs in each matmul of a decode forward: where an ISD chunk's extra tokens go on a CPU.

    python bench/gemm_rows.py                       # SmolLM2-135M's shapes (30 layers), fp32, rows 1,2,3,5
    python bench/gemm_rows.py --rows 1,3,4,8,16,32,64 --linear blas,kernel
    python bench/gemm_rows.py --hidden 896 --intermediate 4864 --kv 128 --vocab 151936 --layers 24   # Qwen2-0.5B
    python bench/gemm_rows.py --weights gguf --rows 1,4,8,16 --linear kernel   # the embedded SmolLM2's Q4_1 / Q8_0

Each projection is timed the way a forward meets it: one weight matrix per layer (``--layers`` distinct copies,
cycled, so the weights stream from memory as they do in a real forward, not from cache), ``x [M, in] @ W.T`` for
M rows (M = 1: an AR step at batch 1; M = 3: an ISD N=2 verify chunk; M = 8: N=2 with 3 draft candidates), through
``F.linear`` (blas) and through dlm's few-row kernel (``dlm.decode.cpu``, what the decoding engine uses for
fp32 on CPU), alternated per repeat. The table gives microseconds per call; the summary the per-forward total, its
ratio to blas at the first M, and the weight bandwidth / arithmetic rate it implies. At batch 1 an AR step is
memory-bound (every weight read once, 2 FLOPs each), so a few more rows need not cost more: on a 2-core Xeon
(AVX-512) blas costs 1.19x / 1.65x / 2.07x of its 1-row time at M = 3 / 4 / 8, the kernel, which streams a
pre-packed weight with prefetching and keeps 8 rows' accumulators in registers, 0.99x / 1.01x / 1.07x.
``--weights gguf`` makes every weight exactly GGUF Q4_1 values (the lm_head Q8_0), as in the embedded SmolLM2, so
the kernel streams them compressed and rebuilds them (once per call past one register pass of rows);
``--weights gguf-int8`` takes the Q4_1 ones with int8 activations (integer dot products, ``DLM_CPU_ACTIVATIONS``).
``--attention S`` adds the decode attention: M rows of one query each over each layer's own cache of S keys (a
distinct cache per layer in a buffer twice as long, as the engine's growing cache keeps it: cold in cache, as in a
batched decode step, where 16 rows x 128 keys are ~3.6 MB of keys and values a layer), through SDPA (blas) and the
kernel's attention.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from dlm.decode import cpu as cpu_kernels


def per_call_us(weights: list[torch.Tensor], x: torch.Tensor, repeats: int, kinds: list[str], packed=None) -> dict:
    """Microseconds per call of each kind (``blas``: F.linear; ``kernel``: dlm's few-row CPU kernel on pre-packed
    weights), the kinds alternated per repeat so that machine noise hits both alike."""
    ext = cpu_kernels.extension() if "kernel" in kinds else None

    def run(kind):
        if kind == "blas":
            for w in weights:
                F.linear(x, w)
        else:
            for w, p in zip(weights, packed):
                ext.linear(x, p, w.shape[0], None, None)

    return {k: v / len(weights) * 1e6 for k, v in alternated(run, kinds, repeats).items()}


def alternated(run, kinds: list[str], repeats: int) -> dict:
    """Seconds per ``run(kind)``, each kind warmed up once, then the kinds alternated per repeat."""
    spent = {k: 0.0 for k in kinds}
    with torch.inference_mode():
        for kind in kinds:  # warm-up
            run(kind)
        for _ in range(repeats):
            for kind in kinds:
                t0 = time.perf_counter()
                run(kind)
                spent[kind] += time.perf_counter() - t0
    return {k: v / repeats for k, v in spent.items()}


def gguf_form(n: int, k: int, kind: str, g: torch.Generator) -> torch.Tensor:
    """A weight ``[n, k]`` as GGUF's dequantization gives it: per 32 inputs d * q + m (Q4_1, q in 0..15) or d * q
    (Q8_0, q int8), d and m fp16 values."""
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-4).half().float()
    if kind == "q4_1":
        m = (-torch.rand(n, k // 32, 1, generator=g) * 0.05).half().float()
        q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
        q[..., 0], q[..., 1] = 0, 15
        return (d * q + m).reshape(n, k)
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 0] = -127
    return (d * q).reshape(n, k)


def pack(w: torch.Tensor, weights: str) -> torch.Tensor:
    """The kernel's packed copy of ``w``: compressed where ``weights`` is gguf (every block fits), else fp32."""
    from dlm.decode.cpu import packing

    ext = cpu_kernels.extension()
    if weights.startswith("gguf"):
        packed = packing.quant_pack(w, ext, "int8" if weights == "gguf-int8" else "f32")
        if packed is not None and packed[1] is None:
            return packed[0]
    return ext.pack(w, False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--kv", type=int, default=192, help="k/v projection width (kv heads x head dim)")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", default="1,2,3,5", help="comma-separated M (the first is the reference)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument(
        "--linear",
        default="blas,kernel",
        help="comma-separated: blas (F.linear) and/or kernel (dlm.decode.cpu, what the decoding "
        "engine uses for fp32 on CPU)",
    )
    ap.add_argument(
        "--weights",
        choices=("f32", "gguf", "gguf-int8"),
        default="f32",
        help="f32: random fp32 weights (fp32 packing); gguf: exact Q4_1 values (lm_head Q8_0), packed compressed; "
        "gguf-int8: the same, the Q4_1 weights taking int8 activations (KernelOptions.activations)",
    )
    ap.add_argument("--attention", type=int, default=0, help="also time the decode attention over S cached keys")
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",") if r]
    kinds = [k for k in args.linear.split(",") if k]
    if not kinds or any(k not in ("blas", "kernel") for k in kinds):
        ap.error(f"--linear takes blas and/or kernel, got {args.linear!r}")
    if "kernel" in kinds and cpu_kernels.extension() is None:
        print("the CPU kernel could not be built here: blas only")
        kinds = ["blas"]
    h, i, kv = args.hidden, args.intermediate, args.kv
    # (name, out, in, calls per layer); lm_head once per forward
    shapes = [
        ("q_proj + o_proj", h, h, 2),
        ("k_proj + v_proj", kv, h, 2),
        ("gate_proj + up_proj", i, h, 2),
        ("down_proj", h, i, 1),
        ("lm_head", args.vocab, h, None),
    ]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    isa = cpu_kernels.isa() if "kernel" in kinds else "-"
    print(
        f"{torch.get_num_threads()} threads, {args.weights} weights, kernel isa {isa}, {args.layers} layers, "
        "weights cycled (cold in cache)"
    )
    cols = [(k, m) for k in kinds for m in rows]
    print(f"{'matmul':<20} {'calls':>5} " + " ".join(f"{k[:4] + ' M=' + str(m) + ' us':>14}" for k, m in cols))
    totals = {c: 0.0 for c in cols}
    nbytes = 0
    for name, out_f, in_f, calls in shapes:
        n = args.layers * calls if calls else 1
        if args.weights.startswith("gguf"):
            kind = "q4_1" if calls else "q8_0"
            ws = [gguf_form(out_f, in_f, kind, g) for _ in range(n)]
        else:
            ws = [torch.randn(out_f, in_f) for _ in range(n)]
        nbytes += out_f * in_f * 4 * n
        packed = [pack(w, args.weights) for w in ws] if "kernel" in kinds else None
        us = {m: per_call_us(ws, torch.randn(m, in_f), args.repeats, kinds, packed) for m in rows}
        for k, m in cols:
            totals[(k, m)] += us[m][k] * n / 1000
        print(f"{name:<20} {n:>5} " + " ".join(f"{us[m][k]:>14.0f}" for k, m in cols))
        del ws, packed
    ref = totals[(kinds[0], rows[0])]
    print(f"all matmuls of one forward ({nbytes / 1e6:.0f} MB of weights), ms (x {kinds[0]} M={rows[0]}):")
    for k in kinds:
        print(
            f"  {k:<7}"
            + ", ".join(
                f"M={m} {totals[(k, m)]:.1f} ({totals[(k, m)] / ref:.2f}x; "
                f"{nbytes / totals[(k, m)] / 1e6:.0f} GB/s, "
                f"{nbytes / 4 * 2 * m / totals[(k, m)] / 1e6:.0f} GFLOP/s)"
                for m in rows
            )
        )
    if args.attention:
        attention(args, rows, kinds)
    return 0


def attention(args, rows: list[int], kinds: list[str]) -> None:
    """Microseconds per layer of M rows' decode attention over their cold caches, blas (SDPA) and kernel."""
    d, s = args.head_dim, args.attention
    heads, kv_heads = args.hidden // d, args.kv // d
    ext = cpu_kernels.extension() if "kernel" in kinds else None
    print(f"decode attention, {heads} heads / {kv_heads} kv heads x {d}, {s} cached keys, one cache per layer:")
    for m in rows:
        caches = [
            (torch.randn(m, kv_heads, 2 * s, d)[:, :, :s], torch.randn(m, kv_heads, 2 * s, d)[:, :, :s])
            for _ in range(args.layers)
        ]
        q = torch.randn(m, heads, 1, d)

        def run(kind):
            for k, v in caches:
                if kind == "blas":
                    F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                else:
                    ext.attend(q, k, v, None, d**-0.5)

        spent = alternated(run, kinds, args.repeats)
        nbytes = 2 * m * kv_heads * s * d * 4
        print(
            f"  M={m:<3} "
            + "  ".join(
                f"{k} {spent[k] / args.layers * 1e6:7.1f} us ({nbytes * args.layers / spent[k] / 1e9:4.1f} GB/s of K/V)"
                for k in kinds
            )
        )


if __name__ == "__main__":
    raise SystemExit(main())
