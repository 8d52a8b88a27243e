"""The README and docs/ stay true: links resolve, the README's `dlm ...` command lines parse, the README is short."""

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose_lines(path: Path):
    """(line number, text) of the lines outside fenced code blocks."""
    fenced = False
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield i, line


def _anchors(path: Path) -> set[str]:
    text = path.read_text()
    heads = {
        re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+\s+(.*)$", text, flags=re.M)
    }
    return heads | set(re.findall(r'<a id="([^"]+)"></a>', text))


def broken_links(path: Path) -> list[str]:
    bad = []
    for n, line in _prose_lines(path):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: not checked (no network)
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                bad.append(f"{path.relative_to(ROOT)}:{n}: link to '{target}': no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{path.relative_to(ROOT)}:{n}: link to '{target}': no such anchor in {dest.name}")
    return bad


def test_every_relative_link_resolves():
    bad = [b for p in DOCS if p.exists() for b in broken_links(p)]
    assert not bad, "\n".join(bad)


def test_code_cites_docs_sections_that_exist():
    """Citations like docs/algorithms.md#isd in code, tests and docs name an anchor that exists."""
    anchors = _anchors(ROOT / "docs" / "algorithms.md")
    bad = []
    for path in [*ROOT.glob("dlm/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("bench/*.py"), *DOCS]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for anchor in re.findall(r"docs/algorithms\.md#([a-z0-9-]+)", line):
                if anchor not in anchors:
                    bad.append(f"{path.relative_to(ROOT)}:{n}: docs/algorithms.md#{anchor} does not exist")
    assert not bad, "\n".join(bad)


def readme_commands() -> list[tuple[int, str]]:
    out, fenced = [], False
    for i, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced and line.strip().startswith("dlm "):
            out.append((i, line.split("#", 1)[0].strip()))
    return out


def test_readme_command_lines_parse():
    from dlm.cli import build_parser

    parser = build_parser()
    cmds = readme_commands()
    assert cmds, "the README shows no dlm command line"
    bad = []
    for n, cmd in cmds:
        argv = shlex.split(cmd)[1:]
        try:
            _, unknown = parser.parse_known_args(argv)
        except SystemExit:
            bad.append(f"README.md:{n}: `{cmd}` does not parse")
            continue
        if unknown:
            bad.append(f"README.md:{n}: `{cmd}`: unknown {' '.join(unknown)}")
    assert not bad, "\n".join(bad)


def test_readme_is_short_and_its_table_cells_are_too():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md: {len(lines)} lines, more than {README_MAX_LINES}"
    long = [
        f"README.md:{n}: a table cell of {len(c.strip())} characters"
        for n, line in _prose_lines(ROOT / "README.md")
        if line.startswith("|")
        for c in line.strip("|").split("|")
        if len(c.strip()) > 200
    ]
    assert not long, "\n".join(long)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_docs_speak_of_the_project(path):
    """No words about how the work was organised (a figure names its machine and command, nothing else)."""
    if not path.exists():
        pytest.skip(f"{path.name} not written")
    words = re.compile(r"\b(this stop|last stop|stop \d+|session|was lent|were lent|no GPU was lent)\b", re.I)
    bad = [
        f"{path.relative_to(ROOT)}:{n}: '{m.group(0)}'"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for m in [words.search(line)]
        if m
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_the_readme_python_example_runs_without_deprecated_spellings(smollm2_path):
    """The README's Python block, executed as a user would paste it (the real embedded model), with dlm's own
    DeprecationWarnings as errors: the example shows the current API."""
    import re
    import warnings

    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Python\n\n```python\n(.*?)```", text, re.S)
    assert block, "README.md has no Python example under '## Python'"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scope: dict = {}
        exec(compile(block.group(1), "README.md", "exec"), scope)  # noqa: S102 - the README's own example
    # a deprecation raised at the example's own lines (dlm warns at its caller) or inside dlm is the example's
    ours = [
        w
        for w in caught
        if issubclass(w.category, DeprecationWarning)
        and (w.filename == "README.md" or "/dlm/" in w.filename.replace("\\", "/"))
    ]
    assert not ours, [str(w.message) for w in ours]
    out = scope["out"]
    assert len(out[0].token_ids) == 16 and out[0].stats.forwards <= 16


def test_every_dlm_environment_variable_is_read_through_settings_and_documented():
    """dlm.settings is the one place that reads a DLM_* variable; docs/DEVELOPING.md's table is its table; every
    DLM_* name in the code is one of its variables."""
    import re

    from dlm.settings import VARIABLES, table

    text = (ROOT / "docs" / "DEVELOPING.md").read_text()
    begin = text.index("<!-- env:begin")
    assert text[text.index("\n", begin) + 1 : text.index("<!-- env:end -->")] == table()
    for path in ROOT.glob("dlm/**/*.py"):
        if path.name == "settings.py":
            continue
        src = path.read_text()
        reads = re.findall(r"os\.(?:environ\.get|getenv)\(\s*[\"'](DLM_\w+)|os\.environ\[\s*[\"'](DLM_\w+)", src)
        assert not reads, f"{path}: reads {reads} directly; use dlm.settings.env"
        for name in set(re.findall(r"[\"'](DLM_[A-Z0-9_]+)[\"']", src)):
            assert name in VARIABLES, f"{path}: {name} is not in dlm.settings.VARIABLES"


def test_one_root_for_dlms_files(monkeypatch, tmp_path):
    """DLM_HOME, else the old DLM_CACHE_DIR (with a DeprecationWarning), else $XDG_CACHE_HOME/dlm, else
    ~/.cache/dlm: the embedded model, the measured choices and vLLM's venv all live under it."""
    from dlm.fsutil import read_records, write_record
    from dlm.serve.vllm import default_venv
    from dlm.settings import home

    for var in ("DLM_HOME", "DLM_CACHE_DIR", "XDG_CACHE_HOME", "DLM_VLLM_VENV"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert home() == tmp_path / "user" / ".cache" / "dlm"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert home() == tmp_path / "xdg" / "dlm"
    monkeypatch.setenv("DLM_CACHE_DIR", str(tmp_path / "old"))
    with pytest.warns(DeprecationWarning, match="DLM_HOME"):
        assert home() == tmp_path / "old"
    monkeypatch.setenv("DLM_HOME", str(tmp_path / "new"))
    assert home() == tmp_path / "new" and default_venv() == tmp_path / "new" / "venv-vllm"
    write_record("probe.json", "k", {"v": 1})  # the measured choices are kept under it
    assert (tmp_path / "new" / "probe.json").is_file() and read_records("probe.json") == {"k": {"v": 1}}


def _code_map(text: str) -> list[tuple[int, str]]:
    """(indent, name) of each file or folder a code map names: the ``text`` block after README's "## The code"."""
    block = text.split("## The code", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    out = []
    for line in block.splitlines():
        if not line.strip() or "->" in line:
            continue
        names = re.split(r"\s{2,}", line.strip())[0]
        indent = len(line) - len(line.lstrip())
        if indent and indent % 2 == 0 and re.fullmatch(r"[\w./]+(, [\w./]+)*", names):
            out += [(indent, n) for n in names.split(", ")]
        elif not indent and re.fullmatch(r"[\w]+/", names):
            out.append((0, names))
    return out


def test_the_readme_code_map_names_files_that_exist():
    """Every file and folder the README's code map names exists where the map puts it (its indentation is the
    folder it is in)."""
    stack: list[str] = []
    missing = []
    for indent, name in _code_map((ROOT / "README.md").read_text()):
        depth = indent // 2
        stack = stack[:depth]
        path = ROOT.joinpath(*stack, name.rstrip("/"))
        if not path.exists():
            missing.append(str(path.relative_to(ROOT)))
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
    assert not missing, missing


def test_the_design_layer_map_names_modules_that_exist():
    """docs/design.md's layer drawing names packages and their modules (``model/ (hub, convert, ...)``): each is in
    dlm/."""
    text = (ROOT / "docs" / "design.md").read_text().split("```text", 1)[1].split("```", 1)[0]
    missing = []
    for package, inside in re.findall(r"(\w+)/ \(([^)]*)\)", text):
        for name in re.findall(r"[\w]+/?", inside.split(":")[0]):
            if name in ("CLI", "flags", "messages", "the", "main", "job", "engine", "decoders", "kernels"):
                continue
            base = ROOT / "dlm" / package / name.rstrip("/")
            if not (base.exists() or base.with_suffix(".py").exists()):
                missing.append(f"{package}/{name}")
    assert not missing, missing
