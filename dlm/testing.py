"""Tiny random models and a tiny tokenizer built in code, for tests, examples and benchmarks.

Nothing here touches the network: the tokenizer is a byte-level BPE trained in milliseconds on a built-in text,
and the models are random-initialized from small configs of the architectures people convert (Llama, Qwen2,
Qwen3, Mistral, GPT-2) and of DiffusionGemma (transformers' own class).
"""

from __future__ import annotations

import os
from pathlib import Path

from dlm.decode.configs import ISDConfig
from dlm.decode.engine import Engine
from dlm.decode.isd import ISDDecoder
from dlm.decode.options import EngineOptions

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gpt2")

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TEXT = """
The quick brown fox jumps over the lazy dog. A diffusion language model denoises masked tokens.
To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and arrows.
First Citizen: Before we proceed any further, hear me speak. All: Speak, speak.
Question: How do you boil an egg? Answer: Put it in boiling water for seven minutes.
The cat sat on the mat and the dog sat on the log. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.
Once upon a time there was a little model that learned to predict the next token and the one after it.
"""


def make_tokenizer(vocab_size: int = 320, text: str | None = None):
    """A fast byte-level BPE tokenizer with eos/pad/bos and a ChatML chat template (no mask token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([(text or _TEXT)] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<pad>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_config(
    arch: str = "llama",
    vocab_size: int = 320,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 512,
    tie: bool = False,
):
    """A tiny config of one of ARCHITECTURES."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, bos_token_id=0, eos_token_id=0, pad_token_id=3, tie_word_embeddings=tie)
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max_positions, **common)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[arch]
    kw = dict(
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        **common,
    )
    if arch == "qwen3":
        kw["head_dim"] = hidden // heads
    return cls(**kw)


def make_model(arch: str = "llama", seed: int = 0, **config_kw):
    """A tiny random causal LM of ``arch`` in fp32, eval mode, with sdpa attention."""
    import torch
    from transformers import AutoModelForCausalLM

    config = make_config(arch, **config_kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.eval()
    return model


def save_tiny(path: str | os.PathLike, arch: str = "llama", seed: int = 0, **config_kw) -> Path:
    """Write a tiny random model + tokenizer as a Hugging Face folder; returns the path."""
    path = Path(path)
    tokenizer = make_tokenizer(config_kw.get("vocab_size", 320))
    model = make_model(arch, seed=seed, **config_kw)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_diffusion_gemma(
    seed: int = 0,
    vocab_size: int = 320,
    canvas: int = 4,
    window: int = 6,
    layer_types: tuple[str, ...] = ("sliding_attention", "sliding_attention", "full_attention"),
    experts: int = 4,
    top_k: int = 2,
    hidden: int = 32,
    **text_config,
):
    """A tiny random ``DiffusionGemmaForBlockDiffusion`` (transformers' own class; fp32, eval mode): a short
    sliding window so that prompts cross it, a mixture of ``experts`` beside each dense MLP, a one-layer vision
    tower (the family always has one) and the special ids of :func:`make_tokenizer`. ``text_config``: fields of its
    ``DiffusionGemmaTextConfig`` to set otherwise (a larger shape for a benchmark)."""
    import torch
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    text = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden + hidden // 2,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        global_head_dim=hidden // 2,
        num_global_key_value_heads=1,
        sliding_window=window,
        num_experts=experts,
        top_k_experts=top_k,
        moe_intermediate_size=hidden // 2,
        layer_types=list(layer_types),
        max_position_embeddings=512,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=3,
    )
    text.update(text_config)
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
    )
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=canvas)
    torch.manual_seed(seed)
    return DiffusionGemmaForBlockDiffusion(config).eval()


def save_tiny_diffusion_gemma(path: str | os.PathLike, seed: int = 0, generation: dict | None = None, **kw) -> Path:
    """Write :func:`make_diffusion_gemma`'s model + :func:`make_tokenizer` as a DiffusionGemma folder (with a
    generation_config.json of ``generation``'s sampler settings, as the published checkpoint has one)."""
    import json

    path = Path(path)
    model = make_diffusion_gemma(seed=seed, **kw)
    model.save_pretrained(path)
    make_tokenizer(kw.get("vocab_size", 320)).save_pretrained(path)
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def oracle_isd(truth: dict, accept: float, seed: int = 0, **settings):
    """An ISD decoder whose drafts are the true greedy continuation with probability ``accept`` each (independently
    per draft position), else a wrong token: ``truth`` maps a request id to its AR tokens (prompt included). The
    target still verifies every draft, so the output stays the AR output; tests use it to reach every acceptance
    outcome, benchmarks to time a set acceptance rate. ``settings``: the ISD decoder's own (stride, fallback, ...);
    it drafts at every step unless ``draft_budget`` says otherwise."""
    return _oracle_class()(truth, accept, seed, **settings)


def oracle_candidates(truth: dict, miss: float, seed: int = 0, **settings):
    """An ISD decoder with draft candidates (``candidates`` K in ``settings``, stride 2) that are wrong tokens with the
    true next one (``truth``: request id -> AR tokens, prompt included) in a random slot, or missing with probability
    ``miss``: candidate hits - whose second token comes from the hit candidate's own row of a tree-shaped chunk -
    happen on most steps. The target still verifies, so the output stays the AR output."""
    return _oracle_candidates_class()(truth, miss, seed, **settings)


def every_isd_path(model, prompts, params, truth: dict, max_batch_size: int = 3):
    """Decode ``prompts`` (request i has id i) on every ISD path - oracle drafts at stride 3 and 2 (``truth``: request
    id -> AR tokens, prompt included), fallback ``all``, the batched verify, the static cache, oracle candidates,
    untrained masks at stride 4 - and yield ``(name, results)``: tests check each against the AR output they
    promise (greedy logit adjustments, structured outputs)."""

    batched = oracle_isd(truth, 0.7, stride=3)
    batched.batch_verify = True
    for name, dec, kw in [
        ("isd-n3", oracle_isd(truth, 0.7, stride=3), {}),
        ("isd-n2", oracle_isd(truth, 0.6, stride=2), {}),
        ("isd-all", oracle_isd(truth, 0.5, stride=3, fallback="all"), {}),
        ("isd-batched", batched, {}),
        ("isd-static", oracle_isd(truth, 0.7, stride=3), {"static_cache": True}),
        ("isd-candidates", oracle_candidates(truth, 0.3, candidates=3, candidate_min_prob=0.0), {}),
        ("isd-untrained", ISDConfig(stride=4, draft_budget="always"), {}),
    ]:
        eng = Engine(model, decoder=dec, options=EngineOptions(max_batch_size=max_batch_size, **kw))
        ids = [eng.add(p, params, request_id=i) for i, p in enumerate(prompts)]
        while eng.has_unfinished():
            eng.step()
        yield name, [eng.pop_result(i) for i in ids]


def _oracle_candidates_class():
    if len(_ORACLE) > 1:
        return _ORACLE[1]
    import torch

    class OracleCandidates(ISDDecoder):
        def __init__(self, truth, miss, seed, **kw):
            super().__init__(ISDConfig(**{"draft_budget": "always", **kw}))
            self.truth, self.miss = truth, miss
            self.rng = torch.Generator().manual_seed(seed)

        def _draft(self, engine, row, mask_logits, first_pos):
            super()._draft(engine, row, mask_logits, first_pos)
            seq = self.truth[row.request_id]
            true = seq[first_pos] if first_pos < len(seq) else 0
            vocab, mask = engine.config.vocab_size, engine.mask_token_id
            cands = []
            for j in range(self.candidates):
                wrong = (true + 1 + j) % vocab
                cands.append(wrong if wrong != mask else (wrong + self.candidates) % vocab)
            if float(torch.rand(1, generator=self.rng)) >= self.miss:
                cands[int(torch.randint(self.candidates, (1,), generator=self.rng))] = true
            row.state.cands = cands

    _oracle_class()
    _ORACLE.append(OracleCandidates)
    return OracleCandidates


_ORACLE: list = []


def _oracle_class():
    if _ORACLE:
        return _ORACLE[0]
    import torch

    class OracleISD(ISDDecoder):
        def __init__(self, truth, accept, seed, **kw):
            super().__init__(ISDConfig(**{"draft_budget": "always", **kw}))
            if not 0.0 <= accept <= 1.0:
                raise ValueError(f"accept must be in [0, 1], got {accept!r}")
            self.truth, self.accept = truth, accept
            self.rng = torch.Generator().manual_seed(seed)

        def _drafted(self, engine, row, first_pos):  # the hook both the per-row and the batched path call
            seq = self.truth[row.request_id]
            vocab, mask = engine.config.vocab_size, engine.mask_token_id
            drafts = []
            for j in range(self.n - 1):
                true = seq[first_pos + j] if first_pos + j < len(seq) else 0
                if float(torch.rand(1, generator=self.rng)) < self.accept:
                    drafts.append(true)
                else:
                    wrong = (true + 1) % vocab
                    drafts.append(wrong if wrong != mask else (wrong + 1) % vocab)
            row.state.drafts = drafts

    _ORACLE.append(OracleISD)
    return OracleISD


class CallCounter:
    """``mod`` (a module or an extension's ops) with a call count per function in ``calls``: which functions a piece
    of code actually ran, e.g. the CPU kernels a forward went through."""

    def __init__(self, mod):
        self.mod, self.calls = mod, {}

    def __getattr__(self, name):
        fn = getattr(self.mod, name)

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return counted


class HostReads:
    """Records what a block of code reads from tensors on the host - what stalls a GPU stream and breaks a CUDA graph
    capture: the Python-level conversions (``tolist``, ``item``, ``int()``/``float()``/``bool()``, ``cpu``,
    ``numpy``) and the ops whose output shape or value the host must wait for (``nonzero``, ``masked_select``,
    ``unique``, scalar reads). ``seen`` lists ``(name, shape)`` in order; a scalar read may show twice (its Python
    call and the op under it)."""

    CONVERSIONS = {"tolist", "item", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy"}
    OPS = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "_local_scalar_dense"}

    def __init__(self):
        self.seen: list[tuple[str, tuple]] = []

    def __enter__(self):
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        seen, conversions, ops = self.seen, self.CONVERSIONS, self.OPS

        def shape(args):
            return tuple(args[0].shape) if args and hasattr(args[0], "shape") else ()

        class Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if getattr(func, "__name__", "") in conversions:
                    seen.append((func.__name__, shape(args)))
                return func(*args, **(kwargs or {}))

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if name in ops:
                    seen.append((f"aten.{name}", shape(args)))
                return func(*args, **(kwargs or {}))

        self._modes = [Functions(), Ops()]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)
        return False
