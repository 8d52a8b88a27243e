"""Training objectives behind one registry: ``mdm``, ``block`` (BD3-LM/SDAR), ``idlm`` (I-DLM) and ``renoise``
(uniform-noise block diffusion: DiffusionGemma).

``get_objective(name, **config)`` returns an :class:`Objective`; ``objective(model, batch, step, generator)``
returns an :class:`ObjectiveOutput` (``loss``, ``parts``, ``num_tokens``). Config field names are the YAML keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dlm.errors import DLMError
from dlm.objectives.configs import CONFIGS, BlockConfig, IDLMConfig, MDMConfig, RenoiseConfig

if TYPE_CHECKING:  # the objectives import torch: loaded on first use, so the configs stay torch-free
    from dlm.objectives.base import Objective, ObjectiveOutput

OBJECTIVE_NAMES = tuple(CONFIGS)  # ("mdm", "block", "idlm", "renoise")
_LAZY = {
    "Objective": "dlm.objectives.base",
    "ObjectiveOutput": "dlm.objectives.base",
    "MDMObjective": "dlm.objectives.mdm",
    "BlockObjective": "dlm.objectives.block",
    "IDLMObjective": "dlm.objectives.idlm",
    "RenoiseObjective": "dlm.objectives.renoise",
}


def _objectives() -> dict[str, type]:
    # torch: loaded on first use, so that the configs (which `dlm --help` reads) stay torch-free
    from dlm.objectives.block import BlockObjective
    from dlm.objectives.idlm import IDLMObjective
    from dlm.objectives.mdm import MDMObjective
    from dlm.objectives.renoise import RenoiseObjective

    return {"mdm": MDMObjective, "block": BlockObjective, "idlm": IDLMObjective, "renoise": RenoiseObjective}


def __getattr__(name: str):
    if name == "OBJECTIVES":
        return _objectives()
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dlm.objectives' has no attribute {name!r}")


def _check_name(name: str) -> None:
    if name not in CONFIGS:
        raise DLMError(f"unknown objective '{name}': valid objectives are {', '.join(OBJECTIVE_NAMES)}")


def get_objective(name: str, **config) -> Objective:
    """The objective ``name`` (one of OBJECTIVE_NAMES) with its config fields as keyword arguments."""
    _check_name(name)
    return _objectives()[name](**config)


def config_class(name: str) -> type:
    """The config dataclass of objective ``name`` (:mod:`dlm.objectives.configs`)."""
    _check_name(name)
    return CONFIGS[name]


__all__ = [
    "OBJECTIVES",
    "OBJECTIVE_NAMES",
    "Objective",
    "ObjectiveOutput",
    "get_objective",
    "config_class",
    "MDMConfig",
    "BlockConfig",
    "IDLMConfig",
    "RenoiseConfig",
]
