"""The house rules, computed from the source (``blueprints/README.md`` draws the layout).

The import map is read with ``ast`` from every module of ``modeld/`` (the generated
``modeld/v1`` aside), every import counted: at module level, inside a function (a lazy import
is still an arrow) and under ``TYPE_CHECKING``. A *room* is a folder of ``modeld/`` (``cache``,
``server/http``, ...) or a module at its top (``contract.py``, ``settings.py``, ...).

1. No import circle between files, nor between rooms.
2. ``cache/`` imports neither ``engine/`` nor ``workers/`` (it owns the protocol it reaches a
   runtime through: ``modeld/cache/runtime.py``).
3. ``engine/``, ``cache/``, ``backends/``, ``workers/`` and ``decoding/`` import no gRPC,
   protobuf or HTTP framework, nor the wire conversion.
4. Every ``blueprints/NNNN...`` path, every ``tests/...py`` path and every path of a file in the
   code's own folders named in the code, the Makefile, the README or a blueprint exists (in
   tests, their docstrings and comments are read: their strings are data).
5. No product code (``modeld/``, ``runtime_client/``) says "issue N": the tracker is not part
   of the house, and its numbers do not tell a reader anything.

An exception (``KNOWN_*``) would name itself and the rewrite that removes it; there are none.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "modeld"

# --- exceptions (none today; an exception names itself and the rewrite that removes it) ---------

KNOWN_ROOM_CIRCLES: set[tuple[str, ...]] = set()
KNOWN_MISSING_PATHS: set[tuple[str, str]] = set()
KNOWN_ISSUE_NUMBERS: set[str] = set()

# --- the import map ----------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {
    _module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "v1" not in p.relative_to(PACKAGE).parts
}


def _imported(name: str, path: Path) -> set[str]:
    """Every dotted name ``path`` imports (``from a import b`` gives ``a.b`` when that is a
    module, else ``a``), relative imports resolved."""
    out: set[str] = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - (node.level - 1)]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            members = [f"{base}.{alias.name}" for alias in node.names]
            modules = [m for m in members if m in MODULES]
            out.update(modules if len(modules) == len(members) else [base, *modules])
    return out


def _owner(dotted: str) -> str | None:
    """The module of ``modeld`` a dotted name lives in, if any."""
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


IMPORTS: dict[str, set[str]] = {}
EXTERNAL: dict[str, set[str]] = {}
for _name, _path in MODULES.items():
    _names = _imported(_name, _path)
    IMPORTS[_name] = {m for n in _names if (m := _owner(n)) is not None and m != _name}
    EXTERNAL[_name] = {n for n in _names if not n.startswith("modeld")}


PARTED = ("modeld.server.http",)
"""Rooms whose subfolders are parts of them, not rooms: the HTTP API dialects (``openai/``,
``anthropic/``, ...) live in the HTTP room, and their own rule is below."""


def room(module: str) -> str:
    """The folder a module lives in, or the module itself at the top of ``modeld/``."""
    path = MODULES[module]
    folder = path.parent
    if folder == PACKAGE:
        return module
    name = _module_name(folder / "__init__.py")
    return next((p for p in PARTED if name.startswith(p + ".")), name)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _rooms() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, targets in IMPORTS.items():
        graph.setdefault(room(module), set()).update(room(t) for t in targets if room(t) != room(module))
    return graph


def test_the_import_map_is_read_from_the_source() -> None:
    """The map sees what the code imports, lazy imports included (a map that saw nothing would
    pass every rule below)."""
    assert {"modeld.cache.warm", "modeld.engine.session", "modeld.server.grpc.servicer"} <= set(MODULES)
    assert "modeld.cache.hold" in IMPORTS["modeld.engine.session"]
    assert "modeld.backends.llama_runtime" in IMPORTS["modeld.backends.llama"]  # inside load()
    assert "modeld.cache.eviction" in IMPORTS["modeld.cache.warm"]  # from modeld.cache import eviction
    assert room("modeld.server.http.app") == "modeld.server.http"
    assert room("modeld.contract") == "modeld.contract"
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_between_files() -> None:
    assert cycles(IMPORTS) == []


def test_no_import_circle_between_rooms() -> None:
    found = {tuple(c) for c in cycles(_rooms())}
    assert found - KNOWN_ROOM_CIRCLES == set()


def test_the_cache_imports_neither_the_engine_nor_the_workers() -> None:
    upward = {
        (module, target)
        for module, targets in IMPORTS.items()
        if module.startswith("modeld.cache")
        for target in targets
        if target.startswith(("modeld.engine", "modeld.workers"))
    }
    assert upward == set()


BELOW_THE_SERVER = ("modeld.engine", "modeld.cache", "modeld.backends", "modeld.workers", "modeld.decoding")
TRANSPORTS = (
    "grpc",
    "grpc_",
    "google.protobuf",
    "google.rpc",
    "starlette",
    "uvicorn",
    "fastapi",
    "httpx",
    "aiohttp",
)
TRANSPORT_MODULES = ("modeld.v1", "modeld.wire", "modeld.server")


def test_the_layers_below_the_server_import_no_transport() -> None:
    bad = {
        (module, name)
        for module in MODULES
        if module.startswith(BELOW_THE_SERVER)
        for name in EXTERNAL[module] | IMPORTS[module]
        if name.startswith(TRANSPORTS) or name.startswith(TRANSPORT_MODULES)
    }
    assert bad == set()


# --- signposts ---------------------------------------------------------------------------------

BLUEPRINTS = {p.name for p in (ROOT / "blueprints").glob("*.md")}
BLUEPRINT_PATH = re.compile(r"blueprints/(\d{4})([\w.-]*)")
TEST_PATH = re.compile(r"(?<![\w/.])tests/[\w/]+\.py")
CODE_PATH = re.compile(r"(?<![\w/.])(?:modeld|runtime_client|bench|scripts)/[\w/]+\.(?:py|sh|md)")
ISSUE = re.compile(r"\bissues? #?\d+", re.IGNORECASE)


def _prose(path: Path) -> str:
    """What a test file says to a reader: its docstrings and comments (its strings are data)."""
    source = path.read_text()
    said = [
        doc
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and (doc := ast.get_docstring(node)) is not None
    ]
    said += [
        t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT
    ]
    return "\n".join(said)


def _signposted() -> dict[str, str]:
    """Every file that points a reader somewhere, and what it says."""
    texts: dict[str, str] = {}
    for folder in ("modeld", "runtime_client", "bench", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "v1" not in path.relative_to(ROOT / folder).parts:
                texts[str(path.relative_to(ROOT))] = path.read_text()
    for path in sorted((ROOT / "tests").rglob("*.py")):
        texts[str(path.relative_to(ROOT))] = _prose(path)
    for path in [ROOT / "Makefile", ROOT / "README.md", *sorted((ROOT / "blueprints").glob("*.md"))]:
        texts[str(path.relative_to(ROOT))] = path.read_text()
    return texts


def _exists(pointer: str) -> bool:
    match = BLUEPRINT_PATH.fullmatch(pointer)
    if match is None:
        return (ROOT / pointer).exists()
    number, rest = match.group(1), match.group(2).rstrip(".")
    return number + rest in BLUEPRINTS if rest else any(n.startswith(number + "-") for n in BLUEPRINTS)


def test_every_path_named_in_the_code_and_the_blueprints_exists() -> None:
    texts = _signposted()
    assert "modeld/cache/warm.py" in texts and len(texts) > 100
    missing = {
        (file, pointer)
        for file, text in texts.items()
        for pattern in (BLUEPRINT_PATH, TEST_PATH, CODE_PATH)
        for pointer in (m.group(0) for m in pattern.finditer(text))
        if not _exists(pointer)
    }
    assert missing - KNOWN_MISSING_PATHS == set()


def test_no_product_code_says_issue_n() -> None:
    said = {
        str(path.relative_to(ROOT))
        for folder in ("modeld", "runtime_client")
        for path in (ROOT / folder).rglob("*.py")
        if ISSUE.search(path.read_text())
    }
    assert said - KNOWN_ISSUE_NUMBERS == set()
