"""Masked-diffusion samplers for bidirectional ``mdm`` DLMs (docs/algorithms.md#mdm-sampling), as a decoder of the
batching engine.

One module per sampler, each with its settings (fields of :class:`~dlm.decode.configs.MDMConfig`) and its typed
per-row state: ``confidence`` (low-confidence remasking), ``random_order`` (``random``), ``threshold``
(Fast-dLLM), ``llada`` (LLaDA's, with classifier-free guidance) and ``dream`` (Dream's ``diffusion_generate``);
:mod:`.base` holds what they share (and the whole-sequence base of the block decoder too), :mod:`.decoder` the
thin decoder shell the engine sees. A new sampler is one module with a :class:`~dlm.decode.mdm.base.Sampler`
subclass, its name in :data:`~dlm.decode.mdm.decoder.SAMPLERS` and in ``configs.MDM_SAMPLERS``.

On the engine (:class:`dlm.decode.engine.Engine`) a batch of requests with different prompt lengths, lengths and
schedules runs together: each step is one forward of every running row's sequence (``confidence``/``random``: the
whole sequence, nothing cached; ``threshold``: the part after the cached prefix). Committed tokens are final, so a
row streams the resolved prefix of its answer as it grows, and stops as soon as that prefix holds a stop token
(the passes the reference would still spend on positions after the stop are saved; the tokens are the same).
The first pass is the request's prefill forward.
"""

from __future__ import annotations

from dlm.decode.mdm.base import DiffusionDecoder, Sampler, even_split, propose
from dlm.decode.mdm.decoder import SAMPLERS, MDMDecoder
from dlm.decode.mdm.dream import dream_ratio, dream_reveal_count
from dlm.decode.mdm.llada import llada_quotas

__all__ = [
    "SAMPLERS",
    "DiffusionDecoder",
    "MDMDecoder",
    "Sampler",
    "dream_ratio",
    "dream_reveal_count",
    "even_split",
    "llada_quotas",
    "propose",
]
