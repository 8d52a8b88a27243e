"""The Python of a CPU decode step: what the kernels' forwards cost around their kernel calls.

    python bench/step_python.py                      # hidden 64, 30 layers: the step is mostly Python
    python bench/step_python.py --hidden 576 --heads 9 --kv-heads 3   # SmolLM2-135M's shapes (random weights)

Builds a Llama-form model with random weights whose arithmetic is tiny (``--hidden 64``), attaches the CPU kernels
(``DLM_CPU_KERNEL=1``: no measurement) and times one-token steps over the engine's growing KV cache, through the
layer loop (each layer's ``LayerForward.body``) and through the one ``decode_stack`` call, the two interleaved
``--rounds`` times. Prints the median step of each round, in ms. Run it in two checkouts to compare the Python
of two commits (state the machine and load: a shared machine moves these by a few percent).
"""

from __future__ import annotations

import argparse
import importlib
import os
import time
import warnings

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    os.environ["DLM_CPU_KERNEL"] = "1"
    warnings.filterwarnings("ignore", category=FutureWarning)  # (transformers renaming past_key_values)

    from dlm.decode import cpu
    from dlm.decode.engine import KVBatch
    from dlm.testing import make_model

    torch.manual_seed(0)
    model = make_model("llama", hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads, layers=args.layers)
    handle = cpu.attach(model.eval())
    if not handle:
        raise SystemExit(f"the CPU kernels are off here: {handle.describe()}")
    # (commits before 15f87d2 kept the switch module-wide, in dlm.decode.cpu.runtime.OPTIONS)
    options = getattr(handle, "options", None) or importlib.import_module("dlm.decode.cpu.runtime").OPTIONS
    ids = torch.randint(5, 100, (1, 8 + args.steps))
    medians: dict[str, list[float]] = {"layer loop": [], "one decode_stack call": []}
    for _ in range(args.rounds):
        for name, one in (("layer loop", False), ("one decode_stack call", True)):
            options.one_call = one
            kv = KVBatch()
            times = []
            with torch.no_grad(), cpu.active():
                model(input_ids=ids[:, :8], past_key_values=kv.cache, use_cache=True)
                for i in range(8, ids.shape[1]):
                    t = time.perf_counter()
                    pos = torch.tensor([[i]])
                    model(input_ids=ids[:, i : i + 1], past_key_values=kv.cache, position_ids=pos, use_cache=True)
                    times.append(time.perf_counter() - t)
            medians[name].append(sorted(times)[len(times) // 2] * 1e3)
    handle.detach()
    print(f"hidden {args.hidden}, {args.layers} layers, {args.steps} one-token steps, median ms per step by round")
    for name, ms in medians.items():
        print(f"{name:24s} " + "  ".join(f"{m:.3f}" for m in ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
