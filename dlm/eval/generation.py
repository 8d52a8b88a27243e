"""Generation tasks (LAMBADA, poem reversal) through the decoding engine, so any decoder can be evaluated.

The tasks call one function, :func:`generate_tokens` ``(em, prompts, max_new_tokens, decode, steps, seed,
batch_size) -> list[list[int]]`` (greedy), which routes to :mod:`dlm.decode`:

- ``ar`` / ``isd``: ``dlm.decode.engine.Engine`` (KV cache, continuous batching);
- ``mdm`` / ``block``: ``dlm.decode.generate`` when the engine offers it; until then a small built-in
  low-confidence-remasking sampler (SPEC 2.2, "confidence") under full attention for ``mdm``.

``decode="auto"`` picks the model's own decoder: ``ar`` for AR models, ``isd`` for I-DLM, ``mdm`` / ``block`` for
those objectives. Any function with the same signature can be passed as ``generate_fn`` instead.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from dlm.errors import DLMError
from dlm.eval.scoring import EvalModel, attention_mask, encode, encode_pair, stderr_of_mean
from dlm.eval.tasks.base import GenExample

DECODERS = ("auto", "ar", "mdm", "block", "isd")
GenerateFn = Callable[..., list[list[int]]]


def resolve_decoder(em: EvalModel, decode: str = "auto") -> str:
    if decode not in DECODERS:
        raise DLMError(f"--decode must be one of {', '.join(DECODERS)}, got '{decode}'")
    if decode == "auto":
        return {None: "ar", "idlm": "isd", "mdm": "mdm", "block": "block"}.get(em.objective, "ar")
    if decode in ("mdm", "block", "isd") and em.mask_token_id is None:
        raise DLMError(f"--decode {decode} needs a diffusion LM (mask token); this is a plain AR model: use --decode ar")
    return decode


def _builtin_mdm(em: EvalModel, prompt: list[int], n_new: int, steps: int) -> list[int]:
    """Low-confidence remasking (SPEC 2.2): after step k, floor(n * (T-k) / T) positions stay masked."""
    model, M = em.model, em.mask_token_id
    x = torch.tensor([prompt + [M] * n_new], device=em.device)
    L = x.shape[1]
    gen = torch.arange(len(prompt), L, device=em.device)
    steps = max(1, min(steps, n_new))
    mask4d = attention_mask(torch.ones(1, L, dtype=torch.bool, device=em.device), causal=False)
    pos = torch.arange(L, device=em.device)[None]
    for k in range(1, steps + 1):
        masked = x[0, gen] == M
        if not masked.any():
            break
        logits = model(input_ids=x, attention_mask=mask4d, position_ids=pos).logits[0].float()
        rows = gen - 1 if em.shift else gen  # with shift, the logit at i-1 predicts token i
        probs = torch.softmax(logits[rows], dim=-1)
        probs[:, M] = 0
        conf, tok = probs.max(-1)
        conf = torch.where(masked, conf, torch.full_like(conf, -1.0))
        n_commit = int(masked.sum()) - (n_new * (steps - k)) // steps
        if n_commit > 0:
            pick = conf.topk(n_commit).indices
            x[0, gen[pick]] = tok[pick]
    return x[0, len(prompt):].tolist()


def generate_tokens(em: EvalModel, prompts: Sequence[list[int]], max_new_tokens: Sequence[int], decode: str = "auto",
                    steps: int | None = None, seed: int = 0, batch_size: int = 8) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (token ids); ``max_new_tokens[i]`` tokens for prompt i (fewer if the
    model stops). ``steps``: denoising steps of the diffusion decoders (default: one per generated token)."""
    decoder = resolve_decoder(em, decode)
    model = em.dlm if em.dlm is not None else em.model
    if decoder in ("ar", "isd"):
        try:
            from dlm.decode.engine import Engine
            from dlm.decode.sampling import SamplingParams
        except ImportError as e:
            raise DLMError(f"--decode {decoder} needs the decoding engine (dlm.decode.engine): {e}") from e
        engine = Engine(model, em.tokenizer, decoder=decoder, max_batch_size=batch_size)
        params = [SamplingParams(max_new_tokens=int(n), temperature=0.0, seed=seed) for n in max_new_tokens]
        return [list(r.token_ids) for r in engine.generate([list(p) for p in prompts], params)]
    import dlm.decode as decode_pkg

    engine_generate = getattr(decode_pkg, "generate", None)
    if callable(engine_generate):
        return engine_generate(model, [list(p) for p in prompts], max_new_tokens=list(max_new_tokens),
                               decoder=decoder, steps=steps, seed=seed, tokenizer=em.tokenizer)
    if decoder == "block":
        raise DLMError("--decode block needs dlm.decode.generate (the block-diffusion sampler), which this "
                       "version of dlm.decode does not offer yet; use --decode mdm or ar")
    with torch.inference_mode():
        return [_builtin_mdm(em, list(p), int(n), steps or int(n)) for p, n in zip(prompts, max_new_tokens)]


def _prompt_ids(em: EvalModel, ex: GenExample) -> list[int]:
    if ex.chat and getattr(em.tokenizer, "chat_template", None):
        text = em.tokenizer.apply_chat_template([{"role": "user", "content": ex.prompt}], tokenize=False,
                                                add_generation_prompt=True)
        return encode(em.tokenizer, text)
    ids = encode(em.tokenizer, ex.prompt)
    return ids or [em.prefix_token_id]


def evaluate_generation(em: EvalModel, examples: Sequence[GenExample], task: str, decode: str = "auto",
                        steps: int | None = None, seed: int = 0, batch_size: int = 8,
                        generate_fn: GenerateFn | None = None, keep_predictions: bool = False) -> dict:
    """Accuracy of a generation task.

    ``max_new_tokens is None`` (LAMBADA): generate exactly as many tokens as the target has (the target encoded
    after the prompt with its leading space) and count an exact match of the stripped text. Otherwise (poem
    reversal) generate that many tokens and count a hit when the target occurs in the text.
    """
    t0 = time.perf_counter()
    fn = generate_fn or generate_tokens
    prompts, lengths, exact = [], [], []
    for ex in examples:
        if ex.max_new_tokens is None:
            ctx, cont = encode_pair(em, ex.prompt, " " + ex.target)
            prompts.append(ctx)
            lengths.append(len(cont))
            exact.append(True)
        else:
            prompts.append(_prompt_ids(em, ex))
            lengths.append(int(ex.max_new_tokens))
            exact.append(False)
    outputs = fn(em, prompts, lengths, decode=decode, steps=steps, seed=seed, batch_size=batch_size)
    hits, preds = [], []
    for ex, out, is_exact in zip(examples, outputs, exact):
        text = em.tokenizer.decode(out, skip_special_tokens=True)
        hit = text.strip() == ex.target.strip() if is_exact else ex.target in text
        hits.append(float(hit))
        preds.append({"id": ex.id, "target": ex.target, "output": text, "hit": bool(hit)})
    result = {"acc": sum(hits) / len(hits), "acc_stderr": stderr_of_mean(hits), "n": len(hits),
              "decode": resolve_decoder(em, decode), "seconds": time.perf_counter() - t0}
    if keep_predictions:
        result["predictions"] = preds
    return result
