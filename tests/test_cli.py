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


def test_unknown_model_is_a_clear_error(tmp_path):
    import pytest

    from dlm.errors import DLMError
    from dlm.model.hub import resolve_model_path

    with pytest.raises(DLMError, match="not a local Hugging Face folder, an alias .* or a hub id"):
        resolve_model_path(str(tmp_path / "nope"))
