"""Training objectives behind one registry: ``mdm``, ``block`` (BD3-LM/SDAR) and ``idlm`` (I-DLM).

``get_objective(name, **config)`` returns an :class:`Objective`; ``objective(model, batch, step, generator)``
returns an :class:`ObjectiveOutput` (``loss``, ``parts``, ``num_tokens``). Config field names are the YAML keys.
"""

from __future__ import annotations

from dlm.errors import DLMError
from dlm.objectives.base import Objective, ObjectiveOutput
from dlm.objectives.block import BlockConfig, BlockObjective
from dlm.objectives.idlm import IDLMConfig, IDLMObjective
from dlm.objectives.mdm import MDMConfig, MDMObjective

OBJECTIVES: dict[str, type[Objective]] = {"mdm": MDMObjective, "block": BlockObjective, "idlm": IDLMObjective}
OBJECTIVE_NAMES = tuple(OBJECTIVES)


def get_objective(name: str, **config) -> Objective:
    """The objective ``name`` (one of OBJECTIVE_NAMES) with its config fields as keyword arguments."""
    if name not in OBJECTIVES:
        raise DLMError(f"unknown objective '{name}': valid objectives are {', '.join(OBJECTIVE_NAMES)}")
    return OBJECTIVES[name](**config)


def config_class(name: str) -> type:
    """The config dataclass of objective ``name`` (for YAML validation / --help)."""
    if name not in OBJECTIVES:
        raise DLMError(f"unknown objective '{name}': valid objectives are {', '.join(OBJECTIVE_NAMES)}")
    return OBJECTIVES[name].Config


__all__ = ["OBJECTIVES", "OBJECTIVE_NAMES", "Objective", "ObjectiveOutput", "get_objective", "config_class",
           "MDMConfig", "BlockConfig", "IDLMConfig"]
