"""Every old spelling dlm still accepts, in one table, with its new spelling and the release that removes it; each is
announced with :class:`DLMDeprecationWarning` through :func:`warn` (a class of its own, so that a test run can
make dlm's deprecations errors without touching other libraries': ``-W error::dlm.deprecations.DLMDeprecationWarning``;
the README's example runs that way). (Renamed command-line flags - ``--isd-token-budget``, ``--block-length`` - are
accepted with a note on stderr: :func:`dlm.decode.configs.deprecated_flag`.)
"""

from __future__ import annotations

import warnings

REMOVED_IN = "0.2"

# old spelling -> the new one
TABLE: dict[str, str] = {
    "generate(..., **settings)": "the decoder's config: generate(model, prompts, ISDConfig(stride=3), params)",
    "load_engine(decode=..., **settings)": "the decoder's config: load_engine(model, ISDConfig(stride=3))",
    "decoder keyword token_budget= / block_length= / method=": "draft_budget= / semi_ar_block= / sampler=",
    "run_eval(decode= / gen_steps= / stride= / candidates= / token_budget=)": (
        "decoder= (a config: its steps, ISDConfig(stride=, candidates=)) and score_batch_tokens="
    ),
    "lm-eval model_args decode / gen_steps / token_budget": "decoder / steps / score_batch_tokens",
    "DLM_CACHE_DIR": "DLM_HOME",
}


class DLMDeprecationWarning(DeprecationWarning):
    """An old spelling of dlm's, one of :data:`TABLE`."""


def warn(old: str, detail: str = "", stacklevel: int = 3, use: str | None = None) -> None:
    """Announce that ``old`` (a key of :data:`TABLE`) was used; ``detail`` names the exact spelling met and ``use``
    its own new spelling (else the table's)."""
    new = use or TABLE[old]
    what = detail or old
    warnings.warn(
        f"{what} is deprecated and will be removed in dlm {REMOVED_IN}: use {new}", DLMDeprecationWarning, stacklevel
    )
