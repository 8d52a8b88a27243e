"""The I-DLM release's LoRA adapter: a PEFT LoRA folder attached to a loaded I-DLM as dlm's gated LoRA (active at
mask positions only, so the clean path and greedy ISD stay the base model's)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from dlm.errors import DLMError
from dlm.model.lora import LoraSettings, _attach_gated, get_gated

ADAPTER_CONFIG = "adapter_config.json"

# adapter_config.json settings that change what a LoRA computes; dlm's gated adapters are plain LoRA (B A x,
# scaled by alpha / r), so any of these set to something else is refused by name
_PLAIN_LORA = {
    "use_rslora": False,
    "use_dora": False,
    "bias": "none",
    "lora_bias": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "layer_replication": None,
    "trainable_token_indices": None,
    "target_parameters": None,
    "alpha_pattern": {},
    "rank_pattern": {},
    "use_qalora": False,
    "alora_invocation_tokens": None,
}


def adapter_folder_error(folder: Path) -> DLMError:
    base = None
    try:
        base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (json.JSONDecodeError, AttributeError, OSError):
        pass
    return DLMError(
        f"'{folder}' is a LoRA adapter ({ADAPTER_CONFIG}), not a model (its base: {base or 'not named'}); "
        f"attach it to the I-DLM it was trained on with dlm.model.families.attach_gated_adapter("
        f"dlm.load_model(BASE), '{folder}') and save_pretrained() the result: a dlm folder every "
        f"command loads"
    )


def attach_gated_adapter(dlm, folder: str | Path):
    """Attach a PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``, as the I-DLM
    release's gated LoRA is published to be served: active at MASK positions only) to an I-DLM as dlm's gated
    LoRA: the adapters act only at mask positions, so the clean path (and greedy ISD) stays the base model's.
    Returns ``dlm``. The mask token's input embedding is the base model's row (the adapter carries none)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg_path = folder / ADAPTER_CONFIG
    if not cfg_path.is_file():
        raise DLMError(f"'{folder}' has no {ADAPTER_CONFIG}; give the folder of a PEFT LoRA adapter")
    if dlm.objective != "idlm":
        raise DLMError(
            f"gated LoRA adapters act at mask positions of an I-DLM; this is a '{dlm.objective}' model: "
            f"load the I-DLM base"
        )
    if get_gated(dlm) is not None:
        raise DLMError("this model has gated-LoRA adapters already")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise DLMError(f"'{cfg_path}' is not valid JSON ({e})") from e
    if cfg.get("peft_type") != "LORA":
        raise DLMError(f"'{cfg_path}': 'peft_type' is {cfg.get('peft_type')!r}; only LORA adapters are known")
    for key, plain in _PLAIN_LORA.items():
        value = cfg.get(key)
        if value not in (None, False, {}, [], "none") and value != plain:
            raise DLMError(
                f"'{cfg_path}': '{key}' is {value!r}; dlm attaches plain LoRA adapters only ({key}={plain!r})"
            )
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise DLMError(f"'{cfg_path}' needs an integer 'r' and a number 'lora_alpha' (got {r!r}, {alpha!r})")
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise DLMError(f"'{weights}' is missing (dlm reads safetensors adapters only)")
    state = load_file(str(weights))
    hf = dlm.base_model_hf
    modules = dict(hf.named_modules())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        m = re.match(r"^base_model\.model\.(.+)\.lora_([AB])(?:\.default)?\.weight$", key)
        if m is None:
            raise DLMError(
                f"'{weights}': tensor '{key}' is not a LoRA A/B weight (embeddings, biases or other "
                f"trained modules are not part of a plain LoRA adapter)"
            )
        name = m.group(1)
        if name not in modules or not isinstance(modules[name], torch.nn.Linear):
            raise DLMError(
                f"'{weights}': '{name}' is not a linear layer of {type(hf).__name__}; the adapter is for "
                f"another base model"
            )
        pairs.setdefault(name, {})[m.group(2)] = t
    names = sorted(pairs)
    for name in names:
        if set(pairs[name]) != {"A", "B"}:
            raise DLMError(f"'{weights}': '{name}' lacks lora_{'B' if 'A' in pairs[name] else 'A'}")
        lin = modules[name]
        a, b = pairs[name]["A"], pairs[name]["B"]
        if tuple(a.shape) != (r, lin.in_features) or tuple(b.shape) != (lin.out_features, r):
            raise DLMError(
                f"'{weights}': '{name}' has LoRA shapes {tuple(a.shape)}, {tuple(b.shape)}; the base "
                f"layer needs ({r}, {lin.in_features}) and ({lin.out_features}, {r})"
            )
    settings = LoraSettings(r=r, alpha=alpha, dropout=0.0, target_modules=names, gated=True)
    _attach_gated(dlm, settings, names)
    with torch.no_grad():
        for name in names:
            adapter = dlm.gated_lora.adapters[name.replace(".", "__")]
            adapter.A.copy_(pairs[name]["A"])
            adapter.B.copy_(pairs[name]["B"])
    return dlm
