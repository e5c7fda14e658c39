"""The planner is pure functions over catalogs, prices and metrics (docs/structure.md): no module of it imports the
engine, lazily or not. `doctor --machine`, which must build an engine, is bench/machine.py's (#26)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_planner_module_imports_the_engine():
    broken = []
    for path in sorted((ROOT / "tokenfactory/planner").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            broken += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                       if n.startswith("tokenfactory.engine")]
    assert not broken, "\n".join(broken)


def test_the_map_says_what_the_code_does():
    text = (ROOT / "docs/structure.md").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("## planner/"))
    assert "pure functions" in line and "no engine" in line
    assert "print_machine_profile" in (ROOT / "tokenfactory/bench/machine.py").read_text()
