import os
import signal
import subprocess
import sys

import pytest

from dlm.cli import main


def test_help_lists_commands(capsys):
    try:
        main(["--help"])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    assert "dlm" in out


def test_no_command_exits_nonzero():
    assert main([]) == 2


@pytest.mark.integration
def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "dlm", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and "dlm" in r.stdout


def test_a_native_abort_in_a_command_prints_the_python_stack():
    """A rank of a distributed run that aborts in C++ (gloo's ``terminate called ...``) is reported by torchrun as a
    bare SIGABRT: dlm's commands enable faulthandler, so the dying process names where each of its threads was."""
    code = (
        "import os, signal, sys\n"
        "from dlm.cli import main\n"
        "main([])\n"
        "def where_it_died():\n"
        "    os.kill(os.getpid(), signal.SIGABRT)\n"
        "where_it_died()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in r.stderr and "where_it_died" in r.stderr


def test_a_launched_rank_ends_without_the_interpreters_teardown():
    """``dlm`` (the executable, ``python -m dlm``) run as one rank of a multi-process launch (WORLD_SIZE > 1) ends
    right after its exit functions, keeping its exit code and its output: the interpreter's teardown, where gloo can
    abort in C++ after a finished run, does not run. Alone (WORLD_SIZE unset or 1) it ends as any Python program."""
    code = (
        "import atexit, sys\n"
        "from dlm import cli\n"
        "class Late:\n"
        "    def __del__(self):\n"
        "        print('teardown ran', flush=True)\n"
        "late = Late()\n"
        "atexit.register(lambda: print('exit functions ran', flush=True))\n"
        "cli.main = lambda argv=None: (print('the command ran', end=' '), 3)[1]\n"
        "cli.entry()\n"
    )
    for world, teardown in (("2", False), ("1", True), (None, True)):
        env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
        if world is not None:
            env["WORLD_SIZE"] = world
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 3, (world, r.stderr[-2000:])
        assert "the command ran" in r.stdout and "exit functions ran" in r.stdout, (world, r.stdout)
        assert ("teardown ran" in r.stdout) == teardown, (world, r.stdout)


def test_main_runs_where_stderr_has_no_file_descriptor():
    """Called from Python with sys.stderr redirected to a buffer (a notebook, a StringIO), main works as before: the
    fault handler, which needs a file descriptor, is skipped there."""
    code = "import io, sys\nsys.stderr = io.StringIO()\nfrom dlm.cli import main\nprint('rc', main([]))\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("rc 2"), r.stderr[-2000:]


def test_unknown_model_is_a_clear_error(tmp_path):
    import pytest

    from dlm.errors import DLMError
    from dlm.model.hub import resolve_model_path

    with pytest.raises(DLMError, match="not a local Hugging Face folder, an alias .* or a hub id"):
        resolve_model_path(str(tmp_path / "nope"))
