"""The token-id decoding engine shared by ``dlm generate``, evaluation and the server.

A batch of requests shares one KV cache (a transformers ``DynamicCache``, keys/values ``[B, H, S, D]``). Rows
have their own prompt lengths and advance by different numbers of tokens per step, so the engine keeps

- ``valid [B, S]``: which cache slots hold a live token of that row. Slots left of a short row (after a merge),
  rejected ISD drafts and mask tokens are *holes*: they stay in the tensor but no query ever attends to them;
- an explicit position id per row (``row.pos``: the position of the row's pending token).

Every step is one "extend" forward: each row feeds a chunk of tokens (its pending token first, then whatever its
decoder wants: nothing for AR, drafts and masks for ISD) under strict causal attention over its valid slots
(:func:`decode_mask`). The diffusion decoders (``mdm``, ``block``) feed the uncached part of their sequence
(prompt tail, committed tokens, masks) and say how its tokens attend to each other (bidirectional, block-causal);
their queries see every valid cached slot of their row. The decoder then says which tokens it commits and how
many leading chunk tokens keep their KV; the rest become holes, and trailing columns that are a hole in every row
are cropped right away. When holes make up most of the cache, :meth:`KVBatch.compact` gathers each row's live
slots together (one copy).

Requests join between steps (``add`` -> prefilled alone at batch 1, so their prefill never depends on the
neighbours, then merged into the running cache by left-padding the shorter side with holes) and leave between
steps (``index_select`` on the batch dimension). The prefill forward is also the request's first decoding step
(its logits at the last prompt token give the first token; ISD appends masks to it as its cold start).

Public API::

    engine = Engine(model, tokenizer, ISDConfig(stride=3), EngineOptions(max_batch_size=8))
    rid = engine.add(prompt_ids, SamplingParams(max_new_tokens=64, seed=0), on_tokens=callback)
    while engine.has_unfinished():
        for event in engine.step():        # StepEvent(request_id, new_token_ids, finished)
            ...
    result = engine.pop_result(rid)        # GenerationResult(token_ids, text, finish_reason, stats)
    # or simply
    results = engine.generate([prompt_ids, ...], params)
"""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dlm.decode import cpu as cpu_kernels
from dlm.decode.attention import use_for_decoding
from dlm.decode.configs import build_decoder, make_config, refusal, with_family_defaults
from dlm.decode.options import EngineOptions, misplaced
from dlm.decode.prefix import PrefixCache
from dlm.decode.sampling import LogitAdjust, RequestStats, SamplingParams, TokenLogprob, token_logprobs
from dlm.decode.static import SPAN_GRANULE, StaticDecode, StaticKV, static_default
from dlm.decode.structured import MAX_AHEAD, GrammarBook
from dlm.decode.threads import ThreadPolicy
from dlm.errors import DLMError
from dlm.model.convert import DLMSpec, cache_kw, max_positions
from dlm.model.families import sampler_defaults
from dlm.model.masks import decode_mask

TokenCallback = Callable[[object, list, bool], None]
# What a decode step keeps of a row's chunk (Decoder.consume): how many leading tokens, or the chunk indices of a
# tree-shaped chunk's kept tokens
Keep = int | list[int]


# -- the batched KV cache -----------------------------------------------------------------------------------
GROWING_CACHE = True  # False: transformers' DynamicLayer (a torch.cat of the whole cache per layer and step)

_growing_layer: list[type] = []


def _growing_layer_class():
    """A ``DynamicLayer`` whose keys/values are views of a larger buffer, so that appending a chunk writes it in
    place instead of copying the whole cache (``torch.cat``) in every layer at every step. Whatever replaces the
    tensors (``select``/``merge``/``compact``, a crop from the left) makes the next append re-buffer once."""
    if _growing_layer:
        return _growing_layer[0]
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        def room(self, b: int, h: int, t: int, d: int, dv: int, like_k: torch.Tensor, like_v: torch.Tensor):
            """``(key buffer, value buffer, n)``: buffers [b, h, >= n + t, d | dv] whose first n slots hold the n
            cached keys / values, with room for t more (a new buffer, twice as long, where the old one is too short
            or was replaced); ``like_k`` / ``like_v`` give a new buffer's dtype and device."""
            k, v = self.keys, self.values
            if k is None or v is None:
                raise RuntimeError("GrowingLayer.room: the layer is not initialized")
            buf = getattr(self, "_buf", None)
            if buf is not None and k is buf[2] and v is buf[3]:  # the views this layer made: in the buffer
                n = k.shape[2]
            else:  # replaced: still the buffer's own start (a crop from the right) or not
                n = k.shape[-2] if k.dim() == 4 else 0
                if not (
                    buf is not None
                    and k.dim() == 4
                    and k.data_ptr() == buf[0].data_ptr()
                    and v.data_ptr() == buf[1].data_ptr()
                    and k.stride() == buf[0].stride()
                    and v.stride() == buf[1].stride()
                ):
                    buf = None
            if buf is not None:
                kb, vb = buf[0], buf[1]
                if kb.shape[:2] != (b, h) or n + t > kb.shape[2]:
                    buf = None
            if buf is None:
                cap = max(2 * (n + t), 64)
                kb = like_k.new_empty(b, h, cap, d)
                vb = like_v.new_empty(b, h, cap, dv)
                if n:
                    kb.narrow(2, 0, n).copy_(k)
                    vb.narrow(2, 0, n).copy_(v)
            return kb, vb, n

        def cropped(self, n: int) -> None:
            """Keep the first n slots (a crop from the right, n <= the current length): still the buffer's views,
            so the next :meth:`room` finds them as its own (an ISD step's dead tail is cropped at every step)."""
            buf = getattr(self, "_buf", None)
            if buf is not None and self.keys is buf[2] and self.values is buf[3]:
                self.extended(buf[0], buf[1], n)
            elif self.keys is not None and self.values is not None:
                self.keys, self.values = self.keys[:, :, :n, :], self.values[:, :, :n, :]

        def extended(self, kb: torch.Tensor, vb: torch.Tensor, n: int):
            """The layer's keys / values become the first n slots of the buffers (after writing into them)."""
            self.keys, self.values = kb.narrow(2, 0, n), vb.narrow(2, 0, n)
            self._buf = (kb, vb, self.keys, self.values)
            return self.keys, self.values

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            b, h, t, d = key_states.shape
            kb, vb, n = self.room(b, h, t, d, value_states.shape[-1], key_states, value_states)
            kb.narrow(2, n, t).copy_(key_states)
            vb.narrow(2, n, t).copy_(value_states)
            return self.extended(kb, vb, n + t)

    _growing_layer.append(GrowingLayer)
    return GrowingLayer


class KVBatch:
    """A DynamicCache plus per-row valid slots; supports extend, keep/crop, merge, select and compact."""

    def __init__(self):
        from transformers import DynamicCache

        self.cache = DynamicCache()
        if GROWING_CACHE and getattr(self.cache, "layer_class_to_replicate", None) is not None:
            self.cache.layer_class_to_replicate = _growing_layer_class()
        self.valid: torch.Tensor | None = None  # [B, S] bool

    @property
    def batch_size(self) -> int:
        return 0 if self.valid is None else self.valid.shape[0]

    @property
    def seq_len(self) -> int:
        return 0 if self.valid is None else self.valid.shape[1]

    def live(self) -> torch.Tensor:
        """``valid`` of a cache that holds rows (a decode step's: running rows always have one)."""
        if self.valid is None:
            raise RuntimeError("KVBatch: no rows in the cache")
        return self.valid

    def _layers(self):
        # initialized layers (a row set that keeps no KV still has [B, H, 0, D] tensors; an unused layer has
        # transformers' 1-D placeholder)
        return [
            layer
            for layer in self.cache.layers
            if getattr(layer, "is_initialized", True)
            and getattr(layer, "keys", None) is not None
            and layer.keys.dim() == 4
        ]

    def _apply(self, fn) -> None:
        for layer in self._layers():
            layer.keys = fn(layer.keys)
            layer.values = fn(layer.values)

    def after_extend(self, keep: torch.Tensor) -> None:
        """Record the validity of the q_len slots the forward appended (``keep [B, Q]``) and crop dead tails."""
        valid = keep if self.valid is None else torch.cat([self.valid, keep], dim=1)
        self.valid = valid
        self._trim()

    def _trim(self) -> None:
        """Drop leading/trailing columns that are a hole in every row."""
        if self.valid is None or self.valid.shape[1] == 0:
            return
        alive = self.valid.any(0)
        if bool(alive.all()):
            return
        idx = alive.nonzero()
        if idx.numel() == 0:
            lo, hi = 0, 0
        else:
            lo, hi = idx[[0, -1], 0].tolist()
            hi += 1
        self.valid = self.valid[:, lo:hi]
        for layer in self._layers():
            if lo == 0 and hasattr(layer, "cropped"):  # a dead tail (the common case): still the buffers' views
                layer.cropped(hi)
            else:
                layer.keys, layer.values = layer.keys[:, :, lo:hi, :], layer.values[:, :, lo:hi, :]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (requests leaving)."""
        if self.valid is None:
            return
        if rows.numel() == 0:
            KVBatch.__init__(self)
            return
        self.valid = self.valid.index_select(0, rows)
        self._apply(lambda t: t.index_select(0, rows))
        self._trim()

    def repeat_rows(self, rows: torch.Tensor) -> None:
        """Rows of the cache as ``rows`` lists them, repeats allowed (a prefill computed once for identical prompts;
        before its ``after_extend``)."""
        self._apply(lambda t: t.index_select(0, rows))
        if self.valid is not None:
            self.valid = self.valid.index_select(0, rows)

    def merge(self, other: KVBatch) -> None:
        """Append ``other``'s rows; the shorter side is left-padded with holes so the columns line up."""
        if other.valid is None:
            return
        if self.valid is None:
            self.cache, self.valid = other.cache, other.valid
            return
        s, o = self.seq_len, other.seq_len
        target = max(s, o)

        def pad(t, n):
            if n == 0:
                return t
            return torch.cat([t.new_zeros(*t.shape[:2], n, t.shape[3]), t], dim=2)

        mine, theirs = self._layers(), other._layers()
        if len(mine) != len(theirs):
            raise RuntimeError("cannot merge KV caches with different numbers of layers")
        for a, b in zip(mine, theirs):
            a.keys = torch.cat([pad(a.keys, target - s), pad(b.keys, target - o)], dim=0)
            a.values = torch.cat([pad(a.values, target - s), pad(b.values, target - o)], dim=0)
        pv = lambda v, n: torch.cat([v.new_zeros(v.shape[0], n), v], dim=1) if n else v  # noqa: E731
        self.valid = torch.cat([pv(self.valid, target - s), pv(other.valid, target - o)], dim=0)

    def hole_fraction(self) -> float:
        if self.valid is None or self.valid.numel() == 0:
            return 0.0
        return 1.0 - float(self.valid.sum(1).max()) / self.valid.shape[1]

    def compact(self) -> None:
        """Gather each row's live slots to the right end (order kept): removes the holes in one copy."""
        if self.valid is None:
            return
        b, s = self.valid.shape
        n = int(self.valid.sum(1).max())
        # a stable sort puts holes (0) first and live slots (1) after, each in their original order
        order = torch.sort(self.valid.to(torch.int8), dim=1, stable=True).indices[:, s - n :]  # [B, n]
        self.valid = self.valid.gather(1, order)

        def gather(t):
            idx = order[:, None, :, None].expand(t.shape[0], t.shape[1], n, t.shape[3])
            return t.gather(2, idx)

        self._apply(gather)


# -- requests -----------------------------------------------------------------------------------------------
@dataclass
class StepEvent:
    """What one request got from one step: its newly committed token ids, and whether it finished (with
    ``SamplingParams.logprobs``: the new tokens' :class:`~dlm.decode.sampling.TokenLogprob`)."""

    request_id: object
    new_token_ids: list[int]
    finished: bool
    logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerationResult:
    request_id: object
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (stop token/string) | "length" (max_new_tokens or context end) | "abort"
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token, None for the first

    def to_dict(self) -> dict:
        d = {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
        }
        if self.logprobs is not None:
            d["logprobs"] = [t.to_dict() for t in self.logprobs]
        if self.prompt_logprobs is not None:
            d["prompt_logprobs"] = [None if t is None else t.to_dict() for t in self.prompt_logprobs]
        d.update(self.stats.to_dict())
        return d


@dataclass
class Row:
    """The engine's state for one running request. ``state`` is the decoder's own (a dict for mdm and block, an
    :class:`~dlm.decode.isd.state.ISDRowState` for ISD): the engine never reads or writes it. ``suffix`` (the
    prefill's tokens after the prompt) and ``fresh`` (drop the row's cached KV before this step's forward, set by
    a decoder that re-feeds from an earlier position) are the engine's."""

    request_id: object
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    stop_ids: frozenset
    on_tokens: TokenCallback | None
    stats: RequestStats
    last: int = -1  # pending token: committed, its KV not in the cache yet
    pos: int = 0  # position id of the pending token
    out: list[int] = field(default_factory=list)
    state: Any = field(default_factory=dict)
    finished: bool = False
    finish_reason: str = ""
    text_cut: int | None = None  # character cut from a stop string
    suffix: list[int] = field(default_factory=list)  # fed after the prompt in the prefill (Decoder.prefill_suffix)
    fresh: bool = False  # this step re-feeds from an earlier position: the row's cached KV goes first
    src: list[int] | None = None  # set by consume: the logits row of each committed token (None: 0, 1, ...)
    logprobs: list[TokenLogprob] | None = None  # the committed tokens' (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    adjust: LogitAdjust | None = None  # the request's logit bias and penalties (SamplingParams.adjusts)


class Decoder:
    """How a row turns logits into tokens. The engine calls, per row:

    - ``check_request(engine, row)``: refuse a request this decoder cannot run (raises DLMError), at ``add``;
    - ``prefill_suffix(engine, row) -> list[int]``: tokens fed after the prompt in the prefill forward;
    - ``chunk(engine, row) -> list[int]``: the tokens of this step's forward, fed at positions ``row.pos ..``
      (``row.last`` first for the causal decoders). A decoder may move ``row.pos`` back to re-feed positions it
      already cached only together with ``row.fresh = True``: the row's cached KV is then dropped;
    - ``consume(engine, row, logits [Q, V]) -> (committed_ids, keep)``: ``logits[j]`` is the output at position
      ``row.pos + j`` (in the prefill ``row.pos`` is the last prompt token's position and the logits start there);
      ``keep`` = how many chunk tokens from ``row.pos`` on keep their KV (the ones that are now context; in the
      prefill it may be negative: the prompt's tail then keeps no KV either); ``row.pos`` advances by ``keep``.
      A decode step of a tree-shaped chunk (``chunk_layout``) may instead give the chunk indices that keep their
      KV (a list, in position order: e.g. ISD's accepted candidate among several at the same position); the
      others become holes and ``row.pos`` advances by their number. Committed ids are appended in order; a
      causal decoder that took a committed token from another logits row than its index in the committed list
      says so in ``row.src`` (the logits row of each, for the tokens' log-probabilities). A decode
      step calls ``consume_batch(engine, rows, logits [B, Q, V], lengths)`` once, which calls ``consume`` per row
      unless the decoder judges all rows in one call;
    - ``plan_step`` / ``step_done``: once per decode step, before the chunks and after the commits (with the
      step's wall time and committed tokens), for decoders that adapt to measured cost.

    ``causal`` decoders (``ar``, ``isd``) run under strict causal attention over the row's valid slots. The others
    (``mdm``, ``block``) give the attention among a chunk's own tokens with ``chunk_attention``; their queries see
    every valid cached slot of their row.
    """

    name = "base"
    causal = True
    static_ok = True  # whether the static step (dlm.decode.static) can run it

    def model_inputs(self, engine: Engine, rows: list[Row], pos: torch.Tensor, valid: torch.Tensor) -> dict:
        """Extra keyword arguments of this forward's model call, for a decoder whose model takes more than the
        tokens (the renoising decoder's canvas start and self-conditioning): ``pos [B, Q]`` the chunk's positions,
        ``valid [B, K]`` which cached slots are live (the cache's keys come before the chunk's)."""
        return {}

    def check_model(self, engine: Engine) -> None:
        pass

    def check_request(self, engine: Engine, row: Row) -> None:
        pass

    def chunk_attention(self, engine: Engine, row: Row, positions: torch.Tensor) -> torch.Tensor:
        """[n, n] boolean attention among a chunk's tokens at absolute ``positions`` [n] (True = may attend)."""
        n = positions.numel()
        return torch.ones(n, n, dtype=torch.bool).tril_()

    def chunk_layout(self, engine: Engine, row: Row, n: int) -> tuple[list[int], torch.Tensor] | None:
        """For causal decoders whose chunk is a small tree rather than a sequence (ISD's fallback drafts): the
        position offsets of its ``n`` tokens from ``row.pos`` and their [n, n] attention among themselves. None
        (the default): offsets 0..n-1, causal. Only the tokens ``consume`` keeps stay in the cache (the first
        ``keep``, or the listed indices)."""
        return None

    def chunk_positions(self, engine: Engine, row: Row, n: int) -> list[int] | None:
        """For non-causal decoders whose chunk holds more than one copy of a sequence (classifier-free guidance:
        the conditional and the unconditional one): the position offset of each of its ``n`` tokens from
        ``row.pos`` (in the prefill: from 0). None (the default): 0..n-1."""
        return None

    def prefill_suffix(self, engine: Engine, row: Row) -> list[int]:
        return []

    def plan_step(self, engine: Engine, rows: list[Row]) -> None:
        """Called once before each decode step's ``chunk`` calls (e.g. ISD decides whether this step drafts)."""

    def forced(self, engine: Engine, row: Row, tokens: list[int]) -> None:
        """After a commit: the next ``tokens`` that the row's structured output forces (its grammar allows nothing
        else there, up to tokenization). A drafting decoder may propose them; they are verified as any draft."""

    @staticmethod
    def forced_first(row: Row) -> list[int]:
        """The tokens a row's structured output forces before anything is generated (a schema's ``{"key":``): a
        decoder may feed them after the prompt in the prefill (the engine drops a suffix the context cannot hold)."""
        c = row.adjust.constraint if row.adjust is not None else None
        return c.forced() if c is not None else []

    def step_done(self, engine: Engine, rows: list[Row], seconds: float, tokens: int) -> None:
        """Called after each decode step with its wall time (chunks, forward, consume) and committed tokens."""

    def chunk(self, engine: Engine, row: Row) -> list[int]:
        raise NotImplementedError

    def consume(self, engine: Engine, row: Row, logits: torch.Tensor) -> tuple[list[int], Keep]:
        raise NotImplementedError

    def consume_batch(
        self, engine: Engine, rows: list[Row], logits: torch.Tensor, lengths: list[int]
    ) -> list[tuple[list[int], Keep]]:
        """A decode step's ``consume`` of every row at once: ``logits [B, Q, V]``, row i's chunk at its first
        ``lengths[i]`` positions; what :meth:`consume` returns, per row. The default calls :meth:`consume` row by
        row; a decoder may judge all rows in one batched call on the logits' device (ISD)."""
        return [self.consume(engine, row, logits[i, :n]) for i, (row, n) in enumerate(zip(rows, lengths))]


def _model_fields(model):
    """(hf_config, dlm spec or None) of a DiffusionLM or a plain HF causal LM."""

    config = model.hf_config if hasattr(model, "hf_config") else model.config
    return config, DLMSpec.from_config(config)


def make_decoder(decoder, **settings) -> Decoder:
    """The decoder for ``decoder``: a :class:`Decoder` as it is, a config (:mod:`dlm.decode.configs`) or a
    registered name built through the registry (``settings``: the config's fields as keywords)."""
    if isinstance(decoder, Decoder):
        if settings:
            raise DLMError(f"decoder settings {', '.join(sorted(settings))} given with a ready decoder object")
        return decoder

    return build_decoder(make_config(decoder, **settings))


class Engine:
    """Continuous-batching token-id engine. See the module docstring for the design and the API."""

    def __init__(
        self,
        model,
        tokenizer=None,
        decoder="ar",
        options: EngineOptions | None = None,
        **decoder_kw,
    ):
        misplaced(decoder_kw, "Engine")
        self.options = options = options if options is not None else EngineOptions()
        if not isinstance(options, EngineOptions):
            raise DLMError(f"Engine(options=...) takes an EngineOptions, got {type(options).__name__}")
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        self.config, self.spec = _model_fields(model)
        self.mask_token_id = self.spec.mask_token_id if self.spec is not None else None
        self.max_positions = max_positions(self.config) or 1 << 30
        self.device = next(model.parameters()).device
        self._cache_kw = cache_kw(model)
        if getattr(self.config, "_attn_implementation", None) == "flex_attention":
            raise DLMError(
                "the decoding engine builds dense attention masks, which transformers' flex_attention "
                "would not apply; load the model with attn_implementation='sdpa' (or wrap the calls in "
                "dlm.model.convert.dense_mask_attention(model))"
            )
        # grouped-query models: masked chunks attend to the cache without copying it (undone by close())
        self._attn = use_for_decoding(model)
        # fp32 on CPU: linear layers, norms, MLPs, attention through the CPU kernels where they are faster here
        # (dlm.decode.cpu; only inside this engine's forwards; undone by close())
        self._cpu = cpu_kernels.attach(model, options.kernels) if self.device.type == "cpu" else None
        self._cpu_kernel = bool(self._cpu)
        # threads: None leaves torch's setting; an int or "auto" (the cores other processes leave idle, looked at
        # again while decoding: dlm.decode.threads) is set in the thread that steps, and put back by close()
        threads = options.threads
        self._threads = ThreadPolicy(threads) if threads is not None and self.device.type == "cpu" else None
        if not isinstance(decoder, Decoder):  # a published family's own sampler settings, where the caller gave none
            decoder = make_config(decoder, **decoder_kw)
            decoder_kw = {}
            decoder = with_family_defaults(decoder, sampler_defaults(self.config, decoder.name))
        self.decoder = make_decoder(decoder, **decoder_kw)
        self.decoder.check_model(self)
        # static_cache: the decode forward runs with fixed shapes over preallocated KV buffers (dlm.decode.static),
        # captured as CUDA graphs on CUDA (cuda_graphs None: wherever the model allows; False: never); None: the
        # device's default (static_default: on CUDA, off on a CPU)
        static_cache = options.static_cache
        if static_cache is None:
            static_cache = static_default(self.device) and self.decoder.static_ok
        elif static_cache and not self.decoder.static_ok:
            raise DLMError(f"--decode {self.decoder.name} does not run on the static step: drop --static-cache")
        self._static = StaticDecode(self, graphs=options.cuda_graphs) if static_cache else None
        self.kv: KVBatch | StaticKV = self._static.kv if self._static is not None else KVBatch()
        # prefix_cache N: the KV of recent prompts (up to N tokens) reused by prompts that start the same way
        # (dlm.decode.prefix; causal decoders only)
        prefix_cache = options.prefix_cache
        self.prefix = PrefixCache(prefix_cache) if prefix_cache and self.decoder.causal else None
        self.rows: list[Row] = []
        self.waiting: list[Row] = []
        self.results: dict = {}
        self._ids = itertools.count()
        # Pads (the tail of a shorter chunk in a batch) are attended by nobody and their logits are dropped; they
        # must not be the mask token, or a gated-LoRA model would run its adapters on them.
        self.pad_id = 1 if self.mask_token_id == 0 else 0
        self.total_forwards = 0
        eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
        if eos is None:
            eos = getattr(self.config, "eos_token_id", None)
        self.default_stop = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self._grammars: GrammarBook | None = None  # structured outputs' compiler, on first use

    @property
    def max_batch_size(self) -> int:
        return self.options.max_batch_size

    @property
    def compact_threshold(self) -> float:
        return self.options.compact_threshold

    @property
    def kernels(self):
        """What the CPU kernels' attach did (:class:`dlm.decode.cpu.Attached`; None off the CPU): truthy where the
        model's layers run through them, ``.choice`` the measured decision and the path of each layer kind."""
        return self._cpu

    @property
    def mask_id(self) -> int:
        """The mask token's id, for the decoders that feed masks (their ``check_model`` refuses a model without)."""
        if self.mask_token_id is None:
            raise DLMError("this decoder needs a model with a mask token (a DLM)")
        return self.mask_token_id

    def close(self) -> None:
        """Give the caller's model back as it was: the CPU kernels' patches and packed copies removed, the
        attention implementation restored (once the model's last engine is closed). Idempotent."""
        if self._cpu is not None:
            self._cpu.detach()
            self._cpu = None
        self._cpu_kernel = False
        if self._attn is not None:
            self._attn.restore()
            self._attn = None
        if self._threads is not None:
            self._threads.restore()
            self._threads = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- requests in --------------------------------------------------------------------------------------
    def add(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id=None,
        on_tokens: TokenCallback | None = None,
    ):
        """Queue a request; it is prefilled and joins the running batch at the next :meth:`step`."""
        params = params or SamplingParams()
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise DLMError("empty prompt: give at least one token (e.g. the BOS token or some text)")
        if len(prompt_ids) >= self.max_positions:
            raise DLMError(
                f"prompt of {len(prompt_ids)} tokens does not fit the model's context of "
                f"{self.max_positions} positions (max_position_embeddings); shorten the prompt to at "
                f"most {self.max_positions - 1} tokens"
            )
        if self.mask_token_id is not None and self.mask_token_id in prompt_ids:
            raise DLMError(f"the prompt contains the mask token (id {self.mask_token_id}); remove it")
        request_id = next(self._ids) if request_id is None else request_id
        stop = params.stop_token_ids
        stop_ids = frozenset(stop) if stop is not None else (frozenset() if params.ignore_eos else self.default_stop)
        row = Row(
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            generator=params.make_generator(),
            stop_ids=stop_ids,
            on_tokens=on_tokens,
            stats=RequestStats(prompt_tokens=len(prompt_ids)),
        )
        if params.logprobs is not None or params.prompt_logprobs is not None:
            refuse(self.decoder, "scores", "logprobs")
        if params.suffix_ids:
            refuse(self.decoder, "suffix", "a suffix (text after the answer: fill-in-the-middle)")
            vocab = int(self.config.vocab_size)
            if any(not 0 <= t < vocab or t == self.mask_token_id for t in params.suffix_ids):
                raise DLMError(f"the suffix holds a token id outside the vocabulary (0..{vocab - 1}) or the mask id")
        if params.logprobs is not None:
            row.logprobs = []
        if params.adjusts:
            refuse(self.decoder, "scores", "logit_bias, min_tokens, structured outputs and the penalties")
            vocab = int(self.config.vocab_size)
            bad = [t for t, _ in params.logit_bias if not 0 <= t < vocab]
            if bad:
                raise DLMError(f"logit_bias names token id {bad[0]}, outside the vocabulary (0..{vocab - 1})")
            constraint = None
            if params.structured is not None:
                constraint = self.grammars().constraint(params.structured, stop_ids)
            row.adjust = LogitAdjust(params, prompt_ids, vocab, stop_ids, constraint)
        self.decoder.check_request(self, row)
        if self._static is not None:  # KV room for the whole request from the start (+ a chunk's headroom)
            self._static.kv.plan(min(len(prompt_ids) + params.max_new_tokens, self.max_positions) + SPAN_GRANULE)
        row.stats.start_time = time.perf_counter()
        self.waiting.append(row)
        return request_id

    def grammars(self) -> GrammarBook:
        """The structured-output compiler of this engine's tokenizer and vocabulary (built on first use)."""
        if self._grammars is None:
            self._grammars = GrammarBook(self.tokenizer, int(self.config.vocab_size), self.default_stop)
        return self._grammars

    def abort(self, request_id) -> None:
        """Stop a request now (it leaves before the next step)."""
        for row in self.waiting + self.rows:
            if row.request_id == request_id and not row.finished:
                row.finished, row.finish_reason = True, "abort"
        self.waiting = [r for r in self.waiting if not r.finished]
        for r in [r for r in self.rows if r.finished]:
            self._finalize(r)
        self._drop_finished()

    def has_unfinished(self) -> bool:
        return bool(self.rows or self.waiting)

    def pop_result(self, request_id) -> GenerationResult:
        return self.results.pop(request_id)

    # -- the step -----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        """One decode forward for the running rows, then prefill + join of waiting requests (room allowing; one
        forward per group of equal prompt and suffix lengths)."""
        events: list[StepEvent] = []
        if self._threads is not None:
            self._threads.tick()
        if self.rows:
            events += self._decode_step()
        room = self.max_batch_size - len(self.rows)
        if self.waiting and room > 0:
            joining, self.waiting = self.waiting[:room], self.waiting[room:]
            groups: dict[tuple[int, int], list[Row]] = {}
            for row in joining:
                row.last, row.pos = row.prompt_ids[-1], len(row.prompt_ids) - 1
                suffix = self.decoder.prefill_suffix(self, row)
                if len(row.prompt_ids) + len(suffix) > self.max_positions:
                    suffix = []  # the prompt alone: consume then gets its last position's logits only
                row.suffix = suffix
                groups.setdefault((len(row.prompt_ids), len(suffix)), []).append(row)
            for group in groups.values():
                # looked up group by group, so that a prompt can reuse one prefilled just before it
                hits = {id(r): self._lookup(r) for r in group}
                plain = [r for r in group if hits[id(r)] is None]
                if plain:
                    events += self._prefill(plain)
                for r in group:
                    if hits[id(r)] is not None:
                        events += self._prefill([r], past=hits[id(r)])
        return events

    def _lookup(self, row: Row):
        """The prefix cache's hit for a joining row (None: prefill in full)."""
        if self.prefix is None or row.params.prompt_logprobs is not None:
            return None
        return self.prefix.lookup(row.prompt_ids)

    def _forward(
        self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None, cache, logits_to_keep=0, extra=None
    ):
        self.total_forwards += 1
        watch = self._cpu_kernel and ids.numel() == 1  # a 1-row step: what the kernels' choice predicted
        t0 = time.perf_counter() if watch else 0.0
        with cpu_kernels.active(self._cpu_kernel):
            out = self.model(
                input_ids=ids,
                position_ids=pos,
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **{self._cache_kw: cache},
                **(extra or {}),
            )
        if watch and self._cpu is not None:
            self._cpu.observe(time.perf_counter() - t0)
        return out.logits

    def _prefill(self, rows: list[Row], past=None) -> list[StepEvent]:
        """One forward for new rows whose prompt+suffix have the same length (no padding needed): the prompt's KV
        goes into a fresh cache that is then merged into the running one. Rows with the same tokens (``n`` choices
        of one prompt, a prompt sent several times) are computed once and their KV and logits copied. ``past``
        (one row): the prefix cache's ``(c, KV)``, the forward then feeds the tokens after the first c."""
        n = len(rows[0].prompt_ids) + len(rows[0].suffix)
        seqs = [r.prompt_ids + r.suffix for r in rows]
        for r in rows:
            r.suffix = []
        n_out = n - len(rows[0].prompt_ids) + 1
        every = any(r.params.prompt_logprobs is not None for r in rows)  # the logits of every prompt position
        keep_logits = 0 if every else n_out
        first: dict[tuple[int, ...], int] = {}
        src = [first.setdefault(tuple(s), len(first)) for s in seqs] if self.decoder.causal else []
        if past is not None:
            logits, kv = self._prefill_forward(rows, seqs, n, keep_logits, past)
            rows[0].stats.cached_tokens = past[0]
        elif src and len(first) < len(rows):  # causal: a row's KV and logits depend on its own tokens only
            unique = [seqs[src.index(u)] for u in range(len(first))]
            logits, kv = self._prefill_forward(rows, unique, n, keep_logits)
            at = torch.tensor(src, device=self.device)
            logits = logits.index_select(0, at)
            kv.repeat_rows(at)
        else:
            logits, kv = self._prefill_forward(rows, seqs, n, keep_logits)
        if self.prefix is not None:
            layers = kv._layers()
            stored: set[tuple[int, ...]] = set()
            for i, row in enumerate(rows):
                key = tuple(row.prompt_ids)
                if key not in stored:
                    stored.add(key)
                    self.prefix.store(row.prompt_ids, [(la.keys[i : i + 1], la.values[i : i + 1]) for la in layers])
        if every:
            self._prompt_logprobs(rows, logits)
            logits = logits[:, n - n_out :]
        adjusted = logits
        if any(r.adjust is not None for r in rows):  # the kept logits: a chunk from the last prompt token on
            adjusted = self._adjusted(rows, logits, [s[n - n_out :] for s in seqs], {})
        keep_mask = torch.zeros(len(rows), n, dtype=torch.bool)
        consumed = []
        for i, row in enumerate(rows):
            row.stats.forwards += 1
            committed, keep = self.decoder.consume(self, row, adjusted[i])
            if not isinstance(keep, int):
                raise RuntimeError(f"decoder {self.decoder.name!r} kept chunk indices in a prefill (a count is due)")
            keep_mask[i, : max(len(row.prompt_ids) - 1 + keep, 0)] = True
            row.pos += keep
            consumed.append(committed)
        scored = self._logprobs(rows, logits, consumed)
        events = [self._commit(row, c, lp) for row, c, lp in zip(rows, consumed, scored)]
        if past is not None:  # the cached prefix's slots are live; the forward's columns follow them
            kv.valid = torch.ones(1, past[0], dtype=torch.bool, device=self.device)
            keep_mask = keep_mask[:, past[0] :]
        kv.after_extend(keep_mask.to(self.device))
        done = [i for i, r in enumerate(rows) if r.finished]
        for i in done:
            self._finalize(rows[i])
        if done:
            live = [i for i, r in enumerate(rows) if not r.finished]
            kv.select(torch.tensor(live, dtype=torch.long, device=self.device))
        self.kv.merge(kv)
        self.rows.extend(r for r in rows if not r.finished)
        return events

    def _prefill_forward(
        self, rows: list[Row], seqs: list[list[int]], n: int, logits_to_keep: int, past=None
    ) -> tuple[torch.Tensor, KVBatch]:
        """The prefill forward of ``seqs`` (equal lengths ``n``; ``rows``' own when the decoder is not causal) into a
        fresh cache: its logits and the cache. ``past`` ``(c, per-layer KV)``: one sequence whose first c tokens'
        KV is given; the cache starts with it and the forward feeds the rest."""
        kv = KVBatch()
        c = 0
        if past is not None:
            c, layers = past
            for i, (k, v) in enumerate(layers):
                kv.cache.update(k[:, :, :c].to(self.device), v[:, :, :c].to(self.device), i)
        ids = torch.tensor([s[c:] for s in seqs], device=self.device)
        pos = torch.arange(c, n, device=self.device)[None].expand(len(seqs), n - c)
        mask = None  # same length, no holes: plain causal attention (after the given prefix), built by the model
        extra = None
        if not self.decoder.causal:
            offsets = [self.decoder.chunk_positions(self, r, n) for r in rows]
            rel = [torch.arange(n) if o is None else torch.tensor(o) for o in offsets]
            pos = torch.stack(rel).to(self.device)
            mask = torch.stack([self.decoder.chunk_attention(self, r, p) for r, p in zip(rows, rel)])[:, None]
            mask = mask.to(self.device)
            extra = self.decoder.model_inputs(self, rows, pos, torch.zeros(len(rows), 0, dtype=torch.bool))
        p = len(rows[0].prompt_ids) - c  # (a group's prompts are of one length)
        if self.decoder.causal and 0 < p < n - c:
            # A causal decoder's suffix (ISD's masks) goes in a second forward, a decode chunk over the prompt's
            # cache: the prompt's forward is then the very one AR makes, so its KV - and every token after it - is
            # bit for bit AR's. In one forward over prompt and suffix the prompt rows' attention is computed for
            # the whole length (SDPA: other last bits for some lengths, e.g. a 35-token prompt + 1 mask), which
            # int8 activations' rounding turned into other answers (3 of 96 held-out prompts).
            head = self._forward(ids[:, :p], pos[:, :p], None, kv.cache, logits_to_keep=1 if logits_to_keep else 0)
            tail = self._forward(ids[:, p:], pos[:, p:], None, kv.cache)
            return torch.cat([head, tail], dim=1), kv
        return self._forward(ids, pos, mask, kv.cache, logits_to_keep=logits_to_keep, extra=extra), kv

    def _decode_step(self) -> list[StepEvent]:
        t0 = time.perf_counter()
        rows = self.rows
        self.decoder.plan_step(self, rows)
        chunks = [self.decoder.chunk(self, r) for r in rows]
        q = max(len(c) for c in chunks)
        b = len(rows)
        ids = torch.full((b, q), self.pad_id, dtype=torch.long)
        for i, c in enumerate(chunks):
            ids[i, : len(c)] = torch.tensor(c)
        start = torch.tensor([r.pos for r in rows])
        # pads (at the end of short chunks) get clamped positions: harmless, nobody attends to them
        pos = start[:, None] + torch.arange(q)[None]
        trees = {}  # row -> (offsets, attention) of a tree-shaped causal chunk (Decoder.chunk_layout)
        if self.decoder.causal:
            for i, (r, c) in enumerate(zip(rows, chunks)):
                lay = self.decoder.chunk_layout(self, r, len(c))
                if lay is not None:
                    trees[i] = lay
                    pos[i, : len(lay[0])] = start[i] + torch.tensor(lay[0])
        else:
            for i, (r, c) in enumerate(zip(rows, chunks)):
                offsets = self.decoder.chunk_positions(self, r, len(c))
                if offsets is not None:
                    pos[i, : len(c)] = start[i] + torch.tensor(offsets)
        pos.clamp_(max=self.max_positions - 1)
        if self._static is not None:
            logits = self._static.forward(rows, chunks, ids, pos, trees)
        else:
            logits = self._dynamic_forward(rows, chunks, ids, pos, trees)
        keep = torch.zeros(b, q, dtype=torch.bool)
        events = []
        tokens = 0
        for row in rows:
            row.stats.forwards += 1
        adjusted = logits
        if any(r.adjust is not None for r in rows):
            adjusted = self._adjusted(rows, logits, chunks, trees)
        consumed = self.decoder.consume_batch(self, rows, adjusted, [len(c) for c in chunks])
        scored = self._logprobs(rows, logits, [c for c, _ in consumed])
        for i, (row, (committed, kept)) in enumerate(zip(rows, consumed)):
            tokens += len(committed)
            if isinstance(kept, int):
                keep[i, :kept] = True
                row.pos += kept
            else:  # chunk indices of a tree chunk (Decoder.consume)
                keep[i, list(kept)] = True
                row.pos += len(kept)
            events.append(self._commit(row, committed, scored[i]))
        self.kv.after_extend(keep.to(self.device))
        self.decoder.step_done(self, rows, time.perf_counter() - t0, tokens)
        if any(r.finished for r in rows):
            for r in rows:
                if r.finished:
                    self._finalize(r)
            self._drop_finished()
        if self.kv.seq_len > 64 and self.kv.hole_fraction() > self.compact_threshold:
            self.kv.compact()
        return events

    def _dynamic_forward(self, rows: list[Row], chunks: list[list[int]], ids, pos, trees: dict) -> torch.Tensor:
        """The decode forward over the growing cache: the mask built for this step's cache and chunks."""
        q = ids.shape[1]
        valid = self.kv.live()
        fresh = [i for i, r in enumerate(rows) if r.fresh]
        if fresh:  # these rows re-feed from an earlier position: their cached KV goes
            valid[fresh] = False
            for i in fresh:
                rows[i].fresh = False
        if self.decoder.causal:
            # No holes in the cache (plain AR, or ISD rows that kept every token) and no tree chunks: the model's
            # own causal mask is the same, and without an explicit mask a 1-token step needs none at all (cheaper
            # attention).
            if not trees and bool(valid.all()):
                mask = None
            elif not trees:
                mask = decode_mask(valid, q)
            elif len(rows) == 1:  # the one row's tree is the whole chunk
                mask = decode_mask(valid, q, trees[0][1])
            else:  # each tree row's attention among its chunk's tokens, causal elsewhere (a short row's pads)
                attn = torch.ones(q, q, dtype=torch.bool).tril_().repeat(len(rows), 1, 1)
                for i, (_, a) in trees.items():
                    n = len(chunks[i])
                    attn[i, :n, :n] = a
                mask = decode_mask(valid, q, attn)
        else:
            mask = self._chunk_mask(rows, chunks, pos, q)
            extra = self.decoder.model_inputs(self, rows, pos.to(self.device), valid)
            return self._forward(ids.to(self.device), pos.to(self.device), mask, self.kv.cache, extra=extra)
        return self._forward(ids.to(self.device), pos.to(self.device), mask, self.kv.cache)

    def _chunk_mask(self, rows: list[Row], chunks: list[list[int]], pos: torch.Tensor, q: int) -> torch.Tensor:
        """[B, 1, Q, K + Q] mask for non-causal decoders: every valid cached slot of the row, the decoder's
        pattern among the chunk's own tokens, and pads (the tail of a short chunk) attending to themselves only
        (so no query row is empty) while no real token attends to them."""
        valid = self.kv.live().cpu()
        b, k = valid.shape
        mask = torch.zeros(b, 1, q, k + q, dtype=torch.bool)
        for i, (row, c) in enumerate(zip(rows, chunks)):
            n = len(c)
            mask[i, 0, :n, :k] = valid[i]
            mask[i, 0, :n, k : k + n] = self.decoder.chunk_attention(self, row, pos[i, :n])
            if n < q:
                mask[i, 0, n:, k + n :] = torch.eye(q - n, dtype=torch.bool)
        return mask.to(self.device)

    # -- logit bias, penalties, structured outputs ---------------------------------------------------------
    def _chunk_history(self, row: Row, chunk: list[int], tree) -> list[list[int]] | None:
        """For a row with logit adjustments: per chunk position, the chunk's tokens before it that count as output
        there - its ancestors in the chunk (all earlier tokens; a tree chunk's attention says which), less its first
        token (the pending token, or in a prefill the prompt's last: already in the history) and masks."""
        if row.adjust is None:
            return None
        attn = None if tree is None else tree[1]
        m = self.mask_token_id
        return [
            [chunk[k] for k in range(1, j + 1) if chunk[k] != m and (attn is None or bool(attn[j, k]))]
            for j in range(len(chunk))
        ]

    def _adjusted(self, rows: list[Row], logits: torch.Tensor, chunks: list[list[int]], trees: dict) -> torch.Tensor:
        """``logits [B, Q, V]`` of the step's ``chunks`` (their tree layouts in ``trees``, by row) with each
        adjusting row's bias, penalties and grammar applied (a copy; the raw logits stay for the log-probabilities).
        A mask's logits only propose drafts for a position whose history is not known yet: the grammar leaves them
        as they are."""
        out = logits.clone()
        m = self.mask_token_id
        for i, (row, chunk) in enumerate(zip(rows, chunks)):
            ex = self._chunk_history(row, chunk, trees.get(i))
            if row.adjust is not None and ex is not None:
                n = len(ex)
                drafting = [j for j in range(n) if chunk[j] == m]
                out[i, :n] = row.adjust.apply(logits[i, :n], ex, drafting).to(out.dtype)
        return out

    # -- log-probabilities --------------------------------------------------------------------------------
    def _logprobs(
        self, rows: list[Row], logits: torch.Tensor, committed: list[list[int]]
    ) -> list[list[TokenLogprob] | None]:
        """The committed tokens' log-probabilities for the rows that asked (``logits [B, Q, V]``, the step's; each
        token's row from ``row.src``, set by consume), in one batched call; clears ``row.src``."""
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None and committed[i]]
        out: list[list[TokenLogprob] | None] = [None] * len(rows)
        if want:
            bi: list[int] = []
            qi: list[int] = []
            tokens: list[int] = []
            for i in want:
                given = rows[i].src
                src = given if given is not None else list(range(len(committed[i])))
                if len(src) != len(committed[i]):
                    raise RuntimeError(
                        f"decoder {self.decoder.name!r} gave {len(src)} logits rows for {len(committed[i])} tokens"
                    )
                bi += [i] * len(src)
                qi += list(src)
                tokens += committed[i]
            k = max(int(rows[i].params.logprobs or 0) for i in want)
            dev = logits.device
            flat = token_logprobs(
                logits[torch.tensor(bi, device=dev), torch.tensor(qi, device=dev)], tokens, k, self.mask_token_id
            )
            at = 0
            for i in want:
                n, kr = len(committed[i]), int(rows[i].params.logprobs or 0)
                out[i] = [TokenLogprob(t.token_id, t.logprob, t.top[:kr]) for t in flat[at : at + n]]
                at += n
        for r in rows:
            r.src = None
        return out

    def _prompt_logprobs(self, rows: list[Row], logits: torch.Tensor) -> None:
        """The prompt tokens' log-probabilities of the rows that asked, from a prefill's logits of every position
        (``logits [G, n, V]``: position j's logits give the prompt's token j + 1)."""
        for i, row in enumerate(rows):
            k = row.params.prompt_logprobs
            if k is None:
                continue
            ids = row.prompt_ids
            row.prompt_logprobs = [None, *token_logprobs(logits[i, : len(ids) - 1], ids[1:], k, self.mask_token_id)]

    # -- bookkeeping --------------------------------------------------------------------------------------
    def _commit(self, row: Row, committed: list[int], logprobs: list[TokenLogprob] | None = None) -> StepEvent:
        """Append committed tokens, applying stop tokens, max_new_tokens, the context end and stop strings."""
        new: list[int] = []
        p = row.params
        for t in committed:
            new.append(int(t))
            if row.adjust is not None:
                row.adjust.add(new[-1:])
            if int(t) in row.stop_ids:
                row.finished, row.finish_reason = True, "stop"
                break
            if row.adjust is not None and row.adjust.done:  # a complete structured output admits nothing more
                row.finished, row.finish_reason = True, "stop"
                break
            if len(row.out) + len(new) >= p.max_new_tokens:
                row.finished, row.finish_reason = True, "length"
                break
        if new and not row.out:
            row.stats.first_token_time = time.perf_counter()  # diffusion decoders may emit nothing at first
        row.out.extend(new)
        if row.adjust is not None and row.adjust.constraint is not None and not row.finished:
            # the next chunk [pending token, forced...] at positions row.pos .. must fit the context
            ahead = row.adjust.constraint.forced(min(MAX_AHEAD, self.max_positions - row.pos - 1))
            if ahead:
                self.decoder.forced(self, row, ahead)
        if logprobs is not None:
            logprobs = logprobs[: len(new)]
            if row.logprobs is not None:
                row.logprobs.extend(logprobs)
        if not row.finished and row.pos + 1 >= self.max_positions:
            row.finished, row.finish_reason = True, "length"
        if p.stop_strings and self.tokenizer is not None and new:
            text = self.tokenizer.decode(row.out, skip_special_tokens=True)
            hits = [text.find(s) for s in p.stop_strings if s and s in text]
            if hits:
                row.text_cut = min(hits)
                row.finished, row.finish_reason = True, "stop"
        row.stats.new_tokens = len(row.out)
        if row.on_tokens is not None:
            row.on_tokens(row.request_id, new, row.finished)
        return StepEvent(row.request_id, new, row.finished, logprobs)

    def _finalize(self, row: Row) -> None:
        row.stats.end_time = time.perf_counter()
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(row.out, skip_special_tokens=True)
            if row.text_cut is not None:
                text = text[: row.text_cut]
        self.results[row.request_id] = GenerationResult(
            row.request_id,
            row.prompt_ids,
            list(row.out),
            text,
            row.finish_reason,
            row.stats,
            logprobs=None if row.logprobs is None else list(row.logprobs),
            prompt_logprobs=row.prompt_logprobs,
        )

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self.rows) if not r.finished]
        if len(keep) == len(self.rows):
            return
        if self.prefix is not None and isinstance(self.kv, KVBatch) and self.kv.valid is not None:
            for i, r in enumerate(self.rows):
                if r.finished and r.finish_reason != "abort":
                    self._store_finished(i, r)
        self.kv.select(torch.tensor(keep, dtype=torch.long, device=self.device))
        self.rows = [self.rows[i] for i in keep]

    def _store_finished(self, i: int, row: Row) -> None:
        """Into the prefix cache: a finished row's prompt and output, from its live cache slots (in position order:
        the first len(prompt + output) - 1 of them are that sequence's KV, the last token's was never fed), so that
        a chat's next turn, which repeats the answer, starts after it."""
        assert isinstance(self.kv, KVBatch) and self.kv.valid is not None and self.prefix is not None
        seq = row.prompt_ids + row.out
        live = self.kv.valid[i].nonzero().squeeze(1)
        need = len(seq) - 1
        if live.numel() < need or need < self.prefix.min_tokens:
            return
        slots = live[:need]
        layers = [
            (la.keys[i : i + 1].index_select(2, slots), la.values[i : i + 1].index_select(2, slots))
            for la in self.kv._layers()
        ]
        self.prefix.store(seq, layers)

    # -- convenience --------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_tokens: TokenCallback | None = None,
        progress=None,
    ) -> list[GenerationResult]:
        """Run prompts (token ids, or strings when the engine has a tokenizer) to completion, ``max_batch_size``
        at a time with continuous batching; results in prompt order. ``progress``: an object with
        ``update(n)`` (a tqdm bar) told of each finished request."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise DLMError(f"{len(prompts)} prompts but {len(params)} sampling settings")
        ids = []
        for p, sp in zip(prompts, params):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise DLMError("text prompts need a tokenizer; pass token ids or Engine(tokenizer=...)")
                p = self.tokenizer(p, add_special_tokens=False)["input_ids"]
            ids.append(self.add(p, sp, on_tokens=on_tokens))
        done = len(self.results)  # results of earlier requests not popped yet
        while self.has_unfinished():
            self.step()
            if progress is not None and len(self.results) > done:
                progress.update(len(self.results) - done)
                done = len(self.results)
        return [self.pop_result(i) for i in ids]


def refuse(decoder, capability: str, what: str) -> None:
    """DLMError with :func:`dlm.decode.configs.refusal`'s message where ``decoder`` lacks ``capability``."""

    message = refusal(decoder, capability, what)
    if message is not None:
        raise DLMError(message)


def warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)
