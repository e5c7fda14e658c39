"""Layers that point one way (docs/structure.md, "Layers"): every import in tokenfactory/, lazy ones inside
functions included, goes to the importer's own layer or a lower one; the meter, tenants and planner
import no torch; the engine never calls the meter. Fast: the source is parsed, no model is loaded."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tokenfactory"

# Lowest first. A module may import only modules of its own layer or of a lower one.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # With the package's own __init__ (its __version__ and re-exported nouns; see PUBLIC_API).
    ("shared nouns", ("tokenfactory.types", "tokenfactory.config", "tokenfactory.progress", "tokenfactory.levers",
                      "tokenfactory")),
    ("layers", ("tokenfactory.layers",)),
    ("models", ("tokenfactory.models",)),
    ("engine", ("tokenfactory.engine",)),
    ("services", ("tokenfactory.meter", "tokenfactory.tenants", "tokenfactory.planner", "tokenfactory.quality",
                  "tokenfactory.bench")),
    ("fleet", ("tokenfactory.fleet",)),
    ("request service", ("tokenfactory.service",)),
    ("gateway", ("tokenfactory.gateway",)),
    ("batch", ("tokenfactory.batch",)),
    ("responses", ("tokenfactory.responses",)),
    ("serve", ("tokenfactory.serve",)),
    ("cli", ("tokenfactory.cli",)),
)

# Permanent, by design: `tokenfactory.LLM`, the offline API, is re-exported by the package's __init__ through
# a PEP 562 __getattr__, so the engine is imported only when someone asks for it.
PUBLIC_API: frozenset[tuple[str, str]] = frozenset({("tokenfactory", "tokenfactory.engine.llm")})

# Known links that break the order, each being removed; (importer, imported module). Keep this short, and
# delete an entry the day its link goes (the test fails on an entry that no longer matches anything).
ALLOWED: frozenset[tuple[str, str]] = frozenset()

TORCH_FREE = ("tokenfactory.meter", "tokenfactory.tenants", "tokenfactory.planner", "tokenfactory.fleet")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """Index in LAYERS of the longest prefix that names `module`'s package."""
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            # "tokenfactory" names the package's __init__ alone, so a new subpackage must be placed.
            inside = module.startswith(prefix + ".") and prefix != "tokenfactory"
            if (module == prefix or inside) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    if best < 0:
        raise AssertionError(f"{module} is in no layer: add its package to LAYERS here and to docs/structure.md")
    return best


def imports_of(path: Path) -> list[tuple[int, str]]:
    return imports_in(path.read_text(), module_name(path), is_package=path.name == "__init__.py")


def imports_in(source: str, module: str, *, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, tokenfactory module) for every import in the source, at any depth (lazy imports count)."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing package
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:  # `from pkg import sub` imports the submodule pkg.sub when there is one
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub if is_module(sub) else base))
    return [(line, name) for line, name in found if name == "tokenfactory" or name.startswith("tokenfactory.")]


def is_module(name: str) -> bool:
    path = ROOT / Path(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def all_imports() -> list[tuple[str, Path, int, str]]:
    return [(module_name(path), path, line, imported)
            for path in sorted(PACKAGE.rglob("*.py")) for line, imported in imports_of(path)]


def test_every_import_points_down_the_layers() -> None:
    names = [name for name, _ in LAYERS]
    broken = []
    for importer, path, line, imported in all_imports():
        ours, theirs = layer_of(importer), layer_of(imported)
        if theirs > ours and (importer, imported) not in ALLOWED | PUBLIC_API:
            broken.append(f"{path.relative_to(ROOT)}:{line} imports {imported}: {names[ours]} (layer {ours}) may "
                          f"import only {', '.join(names[:ours + 1])}, and {imported} is in {names[theirs]} "
                          f"(layer {theirs})")
    assert not broken, "imports that break the layer order (docs/structure.md, Layers):\n" + "\n".join(broken)


def test_the_engine_never_calls_the_meter() -> None:
    broken = [f"{path.relative_to(ROOT)}:{line} imports {imported}: the engine reports steps as StepStats and "
              f"never calls power or metering code" for importer, path, line, imported in all_imports()
              if importer.startswith("tokenfactory.engine") and imported.startswith("tokenfactory.meter")
              and (importer, imported) not in ALLOWED]
    assert not broken, "\n".join(broken)


def test_allowed_exceptions_are_still_needed() -> None:
    seen = {(importer, imported) for importer, _, _, imported in all_imports()}
    stale = sorted(ALLOWED - seen)
    assert not stale, f"ALLOWED lists links that no longer exist; remove them: {stale}"


def test_the_check_sees_lazy_and_relative_imports() -> None:
    source = "import os\n\ndef f():\n    from tokenfactory.engine import engine\n    from ..gateway import app\n"
    found = imports_in(source, "tokenfactory.meter.x")
    assert found == [(4, "tokenfactory.engine.engine"), (5, "tokenfactory.gateway.app")]
    assert layer_of("tokenfactory.gateway.app") > layer_of("tokenfactory.meter.x")
    assert layer_of("tokenfactory.layers.quant") < layer_of("tokenfactory.models.loader")
    with pytest.raises(AssertionError, match="tokenfactory.elsewhere.x is in no layer"):
        layer_of("tokenfactory.elsewhere.x")


@pytest.mark.parametrize("package", TORCH_FREE)
def test_package_imports_no_torch(package: str) -> None:
    """Every module of the package imported in a fresh interpreter, then sys.modules inspected: torch must
    not be there, and the first of our modules that pulled it in is named."""
    code = f"""
import importlib, json, pkgutil, sys
pkg = importlib.import_module({package!r})
for info in pkgutil.walk_packages(pkg.__path__, {package!r} + "."):
    before = set(sys.modules)
    importlib.import_module(info.name)
    if "torch" in sys.modules:
        print(json.dumps({{"culprit": info.name, "pulled": sorted(m for m in set(sys.modules) - before
                                                           if m.startswith("tokenfactory"))}}))
        sys.exit(0)
print(json.dumps({{"culprit": None}}))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["culprit"] is None, (f"importing {result['culprit']} imports torch (through "
                                       f"{', '.join(result['pulled']) or 'a third-party package'}); "
                                       f"{package} must stay torch-free")


ENGINE_INTERNALS = ("runner", "kv", "scheduler", "speculator", "requests", "sampler", "faults")


def test_nothing_outside_the_engine_holds_its_internals() -> None:
    """The engine has one door (engine/client.py, and LLMEngine's public methods offline): no module outside
    tokenfactory/engine reaches into an engine's scheduler, KV manager, runner, speculator or requests."""
    package = ROOT / "tokenfactory"
    slips = []
    for path in sorted(package.rglob("*.py")):
        if (package / "engine") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS
                    and isinstance(node.value, ast.Name | ast.Attribute)
                    and (node.value.id if isinstance(node.value, ast.Name) else node.value.attr).endswith("engine")):
                slips.append(f"{path.relative_to(ROOT)}:{node.lineno} reads .{node.attr} of an engine")
    assert not slips, "\n".join(slips)


HTTP_PACKAGES = ("fastapi", "starlette", "uvicorn", "h11", "httptools")


def http_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of an HTTP framework in the source, at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        found += [(node.lineno, n) for n in names if n.split(".")[0] in HTTP_PACKAGES]
    return found


def test_the_request_service_knows_nothing_of_http() -> None:
    """tokenfactory/service is the request service's door: a Call and a validated body in, typed results out.
    No module of it imports an HTTP framework (a Request, a Response, request.state), lazily or not."""
    slips = [f"{path.relative_to(ROOT)}:{line} imports {name}" for path in sorted((PACKAGE / "service").rglob("*.py"))
             for line, name in http_imports(path.read_text())]
    assert not slips, "the request service must not import HTTP frameworks:\n" + "\n".join(slips)


def test_the_http_check_sees_lazy_http_imports() -> None:
    source = "import json\n\ndef f():\n    from starlette.requests import Request\n    import fastapi.responses\n"
    assert http_imports(source) == [(4, "starlette.requests"), (5, "fastapi.responses")]
    assert http_imports("from .x import y\nimport httpx\n") == []


# Where a name holds an engine client by convention: `client`, `<x>.client` (a fleet's Replica, Started), and in
# the gateway and the request service `engine`, `served.engine`, `self.engine` (Handler, ServerMetrics, the feed).
CLIENT_USERS = ("fleet", "service", "gateway", "batch", "responses", "serve")
ENGINE_IS_CLIENT = ("service", "gateway", "serve")  # batch/store.py's self.engine is SQLAlchemy's
NOT_CLIENTS = ("request", "ledger", "store")  # Starlette's request.client; SQLAlchemy's ledger.engine


def protocol_members() -> frozenset[str]:
    from tokenfactory.engine.client import EngineClient

    return frozenset(name for name in vars(EngineClient) if not name.startswith("_"))


def _base_name(node: ast.expr) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def held_client(value: ast.expr, package: str) -> bool:
    """Whether `value` (the object whose attribute is read) is an engine client by the conventions above."""
    name = _base_name(value)
    if name == "client":
        return not (isinstance(value, ast.Attribute) and _base_name(value.value) in NOT_CLIENTS)
    if name == "engine" and package in ENGINE_IS_CLIENT:
        return not (isinstance(value, ast.Attribute) and _base_name(value.value) in NOT_CLIENTS)
    return False


def client_attribute_reads(source: str, package: str) -> list[tuple[int, str]]:
    """(line, attribute) of every attribute read on a client, a `getattr(client, ...)` as ".getattr"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and held_client(node.value, package):
            found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and node.args and held_client(node.args[0], package)):
            found.append((node.lineno, "getattr"))
    return sorted(found)


def test_nothing_outside_the_engine_reads_past_the_client_protocol() -> None:
    """Everything the gateway, the fleet and the composition roots need of an engine is on `EngineClient`
    (engine/client.py): no getattr probing, no `.engine` of an AsyncEngine, no dict facts."""
    members = protocol_members()
    slips = []
    for package in CLIENT_USERS:
        for path in sorted((PACKAGE / package).rglob("*.py")):
            for line, attr in client_attribute_reads(path.read_text(), package):
                if attr not in members:
                    slips.append(f"{path.relative_to(ROOT)}:{line} reads .{attr} of an engine client, which the "
                                 f"EngineClient protocol does not offer")
    assert not slips, "\n".join(slips)


def test_the_client_check_sees_what_it_must() -> None:
    source = ("def f(r, served, request, ledger):\n    r.client.engine\n    served.engine.info\n"
              "    request.client.host\n    ledger.engine.begin()\n    getattr(r.client, 'facts')\n")
    assert client_attribute_reads(source, "gateway") == [(2, "engine"), (3, "info"), (6, "getattr")]
    assert {"info", "facts", "subscribe_steps", "replica_states", "generate"} <= protocol_members()


def import_circles(edges: list[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module in the import graph (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            component.append(v)
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle_between_any_two_modules() -> None:
    """Within a layer too: shared nouns go to the lower module (as mini-sglang's core.py does) instead of two
    modules importing each other, lazily or for types only."""
    edges = [(importer, imported) for importer, _, _, imported in all_imports()
             if imported != importer and imported != "tokenfactory" and (importer, imported) not in PUBLIC_API]
    circles = import_circles(edges)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_check_finds_a_lazy_circle() -> None:
    assert import_circles([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]) == [["a", "b", "c"]]
    assert import_circles([("a", "b"), ("b", "c")]) == []
