"""The package's layers: imports go downward only, the three data planes (and the two
rollout engines) do not import each other, and no folder's modules import each other in a
cycle. The contracts are `[tool.importlinter]` in pyproject.toml; this runs import-linter on
them, as a developer would. Imports by string ("distflow_lab.x.y:function"), which the
linter cannot see, are checked here: they name what exists, in their layer or below."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"import-linter found a broken contract:\n{out.stdout}\n{out.stderr}"
    assert "0 broken" in out.stdout and "kept" in out.stdout, out.stdout


def test_contracts_name_every_layer_folder():
    """A new top-level folder must be placed in the layers, or the contract checks nothing about it."""
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in cfg["contracts"] if c["type"] == "layers")["layers"]
    named = {part.strip().split(".")[-1] for layer in layers for part in layer.split("|")}
    folders = {p.name for p in (ROOT / "distflow_lab").iterdir()
               if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    folders = {f.removesuffix(".py") for f in folders}
    assert folders - {"presets"} <= named, f"not in the layers contract: {sorted(folders - named)}"


def test_every_layer_folder_is_checked_for_import_cycles():
    """Inside a folder the modules may import each other only one way round: an acyclic_siblings
    contract names every layer folder (it checks the packages inside them too)."""
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    checked = {a for c in cfg["contracts"] if c["type"] == "acyclic_siblings" for a in c["ancestors"]}
    folders = {f"distflow_lab.{p.name}" for p in (ROOT / "distflow_lab").iterdir()
               if p.is_dir() and (p / "__init__.py").exists()}
    assert folders <= checked, f"not checked for cycles: {sorted(folders - checked)}"


# ---- imports by string ---------------------------------------------------------------------------
# A "distflow_lab.x.y:function" string is an import the layer contract cannot see: the module is
# imported where the string is resolved (a DAG node's function on a worker, an engine factory, a
# registry entry). Such a string may name a module of its own layer or a lower one, never a higher
# one, unless listed here with the reason.

NAMED = re.compile(r"distflow_lab(\.[A-Za-z_]\w*)+:[\w.]*")
UPWARD_BY_STRING: dict[tuple[str, str], str] = {}  # none left; a new one needs its reason here


def _layers() -> list[str]:
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in cfg["contracts"] if c["type"] == "layers")["layers"]
    return [part.strip().split(".")[-1] for layer in layers for part in layer.split("|")]  # top first


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # the package root itself (distflow_lab) is no layer


def _module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _named_functions() -> list[tuple[str, int, str]]:
    """(file relative to the repository, line, "distflow_lab.x.y:fn") for every such string literal in the
    package, also as the literal part of an f-string (f"distflow_lab.algos.grpo:{name}")."""
    found = []
    for path in sorted((ROOT / "distflow_lab").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAMED.fullmatch(node.value):
                found.append((str(path.relative_to(ROOT)), node.lineno, node.value))
    return found


def test_functions_named_by_string_exist_and_point_down_or_across():
    order = _layers()
    found = _named_functions()
    assert any(f == "distflow_lab/algos/registry.py" for f, _, _ in found), "the walk finds the known strings"
    problems, seen = [], set()
    for file, line, name in found:
        module, _, attr = name.partition(":")
        target = _module_file(module)
        if target is None:
            problems.append(f"{file}:{line}: {name!r} names no module of the package")
            continue
        if attr and attr.split(".")[0] not in _top_level_names(target):
            problems.append(f"{file}:{line}: {name!r}: {module} defines no {attr.split('.')[0]!r}")
        here = _layer_of(".".join(Path(file).with_suffix("").parts))
        there = _layer_of(module)
        if here in order and there in order and order.index(there) < order.index(here):
            if (file, name) in UPWARD_BY_STRING:
                seen.add((file, name))
            else:
                problems.append(f"{file}:{line}: {name!r} names the {there!r} layer, above {here!r}: import it "
                                "where the layers allow, or pass it in from above")
    assert not problems, "\n".join(problems)
    stale = sorted(set(UPWARD_BY_STRING) - seen)
    assert not stale, f"listed as exceptions but no longer found (drop them from UPWARD_BY_STRING): {stale}"
