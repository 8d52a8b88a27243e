"""The ``dlm`` command line: ``dlm prepare | convert | train | eval | generate | serve | export | quickstart``.

Each command lives in ``dlm/commands/<name>.py`` with ``add_arguments(parser)`` and ``run(args) -> int``.
Those modules import heavy libraries (torch, transformers) inside ``run`` only, so ``dlm --help`` is instant.
User errors (:class:`dlm.errors.DLMError`) print one line and exit 2; Ctrl-C exits 130. Progress bars only on a
terminal's stderr, transformers' included. A fatal signal (an abort or a crash in native code) prints every thread's
Python stack (:mod:`faulthandler`); a rank of a multi-process launch skips the interpreter's teardown (:func:`entry`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS = {
    "prepare": "text (parquet/jsonl/txt) -> TinyLlama-compatible packed token shards",
    "convert": "turn a Hugging Face causal LM into a diffusion LM (mdm | block | idlm)",
    "train": "train a DLM (one loop for every objective, on accelerate)",
    "eval": "evaluate: multiple choice, LAMBADA, poem reversal; eval-history tables and plots",
    "generate": "decode with ar | mdm | block | isd and print text, forwards, TPF and acceptance",
    "serve": "OpenAI-compatible HTTP server with continuous batching",
    "export": "write a dlm model in a published family's layout (sdar | llada | dream)",
    "quickstart": "the main job: SmolLM2-135M -> a faster I-DLM on this CPU, with a report",
}


def build_parser() -> argparse.ArgumentParser:
    from dlm import __version__

    parser = argparse.ArgumentParser(
        prog="dlm",
        description="dlm: turn pretrained autoregressive LMs into diffusion LMs - data, training, evaluation, "
        "decoding and serving.",
    )
    parser.add_argument("--version", action="version", version=f"dlm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        try:
            module = importlib.import_module(f"dlm.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"dlm.commands.{name}":
                raise
            continue  # a command not built yet is simply not offered
        p = sub.add_parser(
            name,
            help=help_text,
            description=(module.__doc__ or help_text).strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        if "--model" in p._option_string_actions and "--revision" not in p._option_string_actions:
            # every command that takes a model takes a hub model's revision with it (main pins --model to it)
            p.add_argument("--revision", help="with --model org/name: the hub repository's branch, tag or commit")
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    import faulthandler

    from dlm.errors import DLMError

    # A process that dies in native code (a C++ abort in a distributed backend, a crash in a kernel) prints the Python
    # stack of every thread to stderr: under torchrun a dead rank otherwise leaves only its exit signal. A caller whose
    # sys.stderr has no file descriptor (a notebook, a StringIO) goes without it rather than fail.
    if not faulthandler.is_enabled():
        try:
            faulthandler.enable()
        except (AttributeError, OSError, ValueError):
            pass
    if not sys.stderr.isatty():
        # transformers' own bars ("Loading weights: 100%|...") in a log or a pipe are noise; dlm's bars follow the
        # same rule (dlm.progress). Read by huggingface_hub when transformers is first imported, in `run`.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        if getattr(args, "revision", None):
            from dlm.model.hub import with_revision

            args.model = with_revision(args.model, args.revision)
        return int(args._module.run(args) or 0)
    except DLMError as e:
        print(f"dlm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dlm {args.command}: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The ``dlm`` executable and ``python -m dlm``: :func:`main`, then the process ends with its exit code.

    A rank of a multi-process launch (torchrun and ``accelerate launch`` set ``WORLD_SIZE``) ends with
    ``os._exit`` once the exit functions ran and its output is flushed, skipping the interpreter's teardown: there
    torch's gloo backend can abort in C++ (``terminate called without an active exception``, no Python frame in any
    thread) after a finished run - the run's outputs written, the launch reported failed. :func:`main` itself returns
    (a script that calls it goes on)."""
    rc = main()
    if _launched_rank():
        _end_now(rc)
    sys.exit(rc)


def _launched_rank() -> bool:
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def _end_now(rc: int) -> None:
    """Run the exit functions (logging's flush, multiprocessing's children), flush stdio, end the process."""
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(rc)


if __name__ == "__main__":  # pragma: no cover
    entry()
