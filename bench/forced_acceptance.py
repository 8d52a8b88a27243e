"""What ISD's tokens per forward turn into in wall-clock: `--decode ar` against `--decode isd` through the engine
(what `dlm generate` runs), on a random-weight model of a chosen size, with the drafts forced to a set acceptance.

    python bench/forced_acceptance.py                                   # CPU, the embedded model's shape
    python bench/forced_acceptance.py --device cuda --dtype bf16 --shape 1b --batch-size 1,8,32 --static-cache both

A random-weight model drafts nothing useful, and a trained one drafts what it drafts; to see the wall-clock
ratio that an acceptance rate gives, each draft here is replaced (``dlm.testing.oracle_isd``: the ISD decoder's
``_drafted`` hook, which both its per-row and batched paths call) by the model's true greedy token with probability
``--acceptance`` and by a wrong one otherwise, independently per draft position. The true tokens come from a first, timed AR run of the
same prompts; the target still verifies every draft, so each ISD run's output must equal the AR run's token for
token (checked, reported). The gated-LoRA adapters are active on the masks (random, non-zero), as in a trained
checkpoint.

Reported per batch size: AR tok/s; per acceptance a: ISD tok/s, tokens per forward (TPF), TPF and wall-clock vs AR,
and identical outputs. ``--static-cache both`` runs each decoder with the dynamic and the static decode step (on CUDA
the static step is captured as CUDA graphs, the adapters' gate sync-free inside them).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from shapes import machine, random_gated_adapters, random_idlm  # noqa: E402

from dlm.decode.options import EngineOptions


def where(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{machine()}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="alias or folder whose config and tokenizer are used")
    ap.add_argument("--shape", default="base", help="base (the model's own) | 0.5b | 1b (bench/shapes.py)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--stride", type=int, default=3, help="ISD stride N (N-1 drafts per verify)")
    ap.add_argument("--acceptance", default="0,0.5,0.8,1", help="per-draft acceptance rates to force")
    ap.add_argument("--batch-size", default="1", help="comma-separated batch sizes (requests run together)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--targets", default="q_proj,v_proj", help="modules of the random gated adapters")
    ap.add_argument("--static-cache", default="off", choices=["off", "on", "both"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch

    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams
    from dlm.model.hub import resolve_model_path
    from dlm.testing import oracle_isd

    rates = [float(x) for x in args.acceptance.split(",") if x]
    if any(not 0.0 <= a <= 1.0 for a in rates):
        ap.error(f"--acceptance takes rates in [0, 1], got {args.acceptance!r}")
    device = torch.device(args.device)
    dlm = random_idlm(resolve_model_path(args.model), args.shape, args.seed, block_size=args.stride - 1)
    random_gated_adapters(dlm, args.lora_r, args.targets)
    dlm.to(device=device, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    dlm.eval()
    vocab = dlm.hf_config.vocab_size

    gen = torch.Generator().manual_seed(args.seed)
    statics = {"off": [False], "on": [True], "both": [False, True]}[args.static_cache]
    print(
        f"model {args.model} random init, shape {args.shape} ({sum(p.numel() for p in dlm.model.parameters()) / 1e6:.0f}M"
        f" parameters), {args.dtype}, {where(device)}; gated adapters r={args.lora_r} on {args.targets}; "
        f"stride {args.stride}; {args.prompt_tokens} prompt + {args.new_tokens} new tokens per request, greedy"
    )
    print(
        "| batch | static | decoder | forced acceptance | tok/s | TPF | TPF vs AR | wall-clock vs AR | identical to AR |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    for B in [int(x) for x in args.batch_size.split(",") if x]:
        prompts = [torch.randint(2, vocab - 1, (args.prompt_tokens,), generator=gen).tolist() for _ in range(B)]
        for static in statics:

            def run(decoder):
                eng = Engine(dlm, decoder=decoder, options=EngineOptions(max_batch_size=B, static_cache=static))
                try:
                    # warm-up on the whole batch, long enough to meet the chunk sizes the run will: with the static
                    # step on CUDA each (batch, chunk, key span) shape is captured once, outside the timed run
                    eng.generate(prompts, SamplingParams(max_new_tokens=min(16, args.new_tokens), ignore_eos=True))
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    ids = [eng.add(p, params, request_id=i) for i, p in enumerate(prompts)]
                    t0 = time.perf_counter()
                    while eng.has_unfinished():
                        eng.step()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    wall = time.perf_counter() - t0
                    res = [eng.pop_result(i) for i in ids]
                finally:
                    eng.close()
                new = sum(r.stats.new_tokens for r in res)
                fw = sum(r.stats.forwards for r in res)  # the prefill's forward (it gives the first token) included
                return res, new / wall, new / max(fw, 1)

            ar_res, ar_tps, ar_tpf = run("ar")
            truth = {i: list(r.prompt_ids) + list(r.token_ids) for i, r in enumerate(ar_res)}
            s = "on" if static else "off"
            print(f"| {B} | {s} | ar | - | {ar_tps:.1f} | {ar_tpf:.2f} | 1.00x | 1.00x | - |")
            for rate in rates:
                dec = oracle_isd(truth, rate, args.seed, stride=args.stride, draft_budget="always")
                res, tps, tpf = run(dec)
                same = sum(r.token_ids == a.token_ids for r, a in zip(res, ar_res))
                parted = [first_difference(r.token_ids, a.token_ids) for r, a in zip(res, ar_res)]
                parted = [n for n in parted if n is not None]
                where_parted = f" (others part at token {min(parted)}-{max(parted)})" if parted else ""
                print(
                    f"| {B} | {s} | isd N={args.stride} | {rate:.2f} | {tps:.1f} | {tpf:.2f} | {tpf / ar_tpf:.2f}x | "
                    f"{tps / ar_tps:.2f}x | {same}/{len(res)}{where_parted} |",
                    flush=True,
                )
    if args.dtype == "bf16":
        print(
            "bf16: a verify forward of several rows rounds differently from a one-row AR step, so at a near tie (random "
            "weights have many) an output can part from AR's; in fp32 they are identical. After such a point the forced "
            "drafts follow AR's path, not ISD's, so they understate the acceptance asked for."
        )
    return 0


def first_difference(a, b) -> int | None:
    """The index of the first token where ``a`` and ``b`` differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


if __name__ == "__main__":
    sys.exit(main())
