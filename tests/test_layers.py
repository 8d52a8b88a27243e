"""The layers of docs/design.md hold for every import in dlm/, at module level and inside functions: model/,
objectives/ and data/ import nothing from train/, eval/, serve/, decode/; decode/ imports model/ (and the base
modules) but not train/, eval/, serve/, objectives/; and the top-level packages import each other without a circle.
(Modules of one package may import each other inside functions; the layering is between packages.) And no function
of dlm/ takes more than ten parameters."""

from __future__ import annotations

import ast
import collections
import importlib
from dataclasses import fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UPPER = {"train", "eval", "serve", "decode", "commands", "quickstart", "cli"}
FORBIDDEN = {
    "model": UPPER | {"config"},
    "objectives": UPPER,
    "data": UPPER,
    "decode": UPPER - {"decode"} | {"objectives"},
}


def _imports() -> dict[str, set[str]]:
    """dlm module -> the dlm modules it imports anywhere in its file."""
    out: dict[str, set[str]] = collections.defaultdict(set)
    for path in (ROOT / "dlm").rglob("*.py"):
        mod = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dlm":
                out[mod].add(node.module)
            elif isinstance(node, ast.Import):
                out[mod].update(a.name for a in node.names if a.name.split(".")[0] == "dlm")
    return out


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_each_layer_imports_only_what_it_may():
    bad = [
        f"{m} imports {t}"
        for m, targets in _imports().items()
        for t in targets
        if _package(t) in FORBIDDEN.get(_package(m), set())
    ]
    assert not bad, bad


def test_the_packages_import_each_other_without_a_circle():
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for m, targets in _imports().items():
        for t in targets:
            if _package(m) != _package(t) and _package(t) != "dlm" and _package(m) not in ("dlm", "__main__"):
                graph[_package(m)].add(_package(t))
    state: dict[str, int] = {}

    def cycle_from(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state:
                found = cycle_from(nxt, path + [node])
                if found:
                    return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = cycle_from(node, [])
            assert found is None, " -> ".join(found)


MAX_PARAMETERS = 10


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """A function's named parameters (``self`` / ``cls`` and ``*args`` / ``**kwargs`` not counted)."""
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    return names[1:] if names and names[0] in ("self", "cls") else names


def test_no_function_takes_more_than_ten_parameters():
    """Settings travel in their config objects (a decoder's config, EngineOptions, EvalSettings, the training
    config), not as long keyword lists: no function or method in dlm/ names more than ten parameters."""
    long = []
    for path in sorted((ROOT / "dlm").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = len(_parameters(node))
                if n > MAX_PARAMETERS:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}() takes {n}")
    assert not long, "group these settings in the config object they belong to:\n" + "\n".join(long)


def test_the_cpu_kernels_python_is_split_by_concern():
    """dlm/decode/cpu/ keeps each concern in its own file (runtime, modules, layer, stack, adapters, packing, build,
    choice): none over 500 lines, and the kernels' state and switches are attributes of runtime's STATE and
    the attach's own KernelOptions (which the attached model's forwards read), not module-wide objects or
    one-element module lists that tests flip."""
    long = []
    for path in sorted((ROOT / "dlm" / "decode" / "cpu").glob("*.py")):
        n = len(path.read_text().splitlines())
        if n > 500:
            long.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not long, "split these by concern:\n" + "\n".join(long)
    from dlm.decode.cpu import runtime

    assert {f.name for f in fields(runtime.KernelOptions)} == {
        "mode",
        "quant",
        "adapter_form",
        "activations",
        "one_call",
        "keep_plans",
    }
    shared = [
        f"{path.name}: {name}"
        for path in sorted((ROOT / "dlm" / "decode" / "cpu").glob("*.py"))
        for name, value in vars(
            importlib.import_module(f"dlm.decode.cpu.{path.stem}".removesuffix(".__init__"))
        ).items()
        if isinstance(value, runtime.KernelOptions)
    ]
    assert not shared, f"module-wide KernelOptions (pass them to attach instead): {shared}"
    cells = [
        f"{path.name}: {node.targets[0].id}"
        for path in sorted((ROOT / "dlm" / "decode" / "cpu").glob("*.py"))
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.List)
        and len(node.value.elts) == 1
        and isinstance(node.targets[0], ast.Name)
    ]
    assert cells == ["stack.py: _stack_runs"], cells  # (a counter the stack's own check reads)


def _lazy_imports() -> list[tuple[Path, int, list[str]]]:
    """Each import of a dlm module inside a function, outside dlm/cli.py and dlm/commands/: (file, line, the file's
    lines)."""
    out = []
    for path in sorted((ROOT / "dlm").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "dlm/cli.py" or rel.startswith("dlm/commands/"):
            continue  # `dlm --help` imports every command module to build its parser: their imports wait for run()
        text = path.read_text()
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text)):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    is_dlm = isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "dlm"
                    is_dlm |= isinstance(node, ast.Import) and any(a.name.split(".")[0] == "dlm" for a in node.names)
                    if is_dlm:
                        out.append((path, node.lineno, lines))
    return out


def test_imports_inside_functions_say_why():
    """An import inside a function hides a dependency from the top of the file, so it stays only with its reason:
    a comment on its line or above its block of imports (torch kept out of `dlm --help`, a circle, an optional
    extra). dlm/cli.py and dlm/commands/ import inside run() as a rule (said once, here and in cli.py)."""
    silent = []
    for path, line, lines in _lazy_imports():
        i = line - 1
        while i > 0 and lines[i - 1].strip().startswith(("from dlm", "import dlm")):
            i -= 1
        said = "#" in lines[line - 1] or lines[i - 1].strip().startswith("#")
        if not said:
            silent.append(f"{path.relative_to(ROOT)}:{line}")
    assert not silent, "move these imports to the top of the file, or say why they wait:\n" + "\n".join(silent)


def test_dlm_help_imports_neither_torch_nor_transformers():
    """What the imports inside functions buy: `dlm --help` (every command's parser) and `import dlm` stay free of
    torch and transformers."""
    import subprocess
    import sys

    code = (
        "import sys, contextlib, io\n"
        "from dlm import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    cli.main(['--help'])\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert run.stdout.strip() == "[]", run.stdout + run.stderr
