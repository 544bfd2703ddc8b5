"""The house rules, computed from the source (``blueprints/README.md`` draws the layout).

The import map is read with ``ast`` from every module of ``modeld/`` (the generated
``modeld/v1`` aside), ``runtime_client/`` and ``bench/``, every import counted: at module level,
inside a function (a lazy import is still an arrow) and under ``TYPE_CHECKING``. A *room* is a
folder (``modeld/cache``, ``modeld/server/http``, ``runtime_client``, ``bench``, ...) or a module
at the top of ``modeld/`` (``contract.py``, ``settings.py``, ...); an HTTP API's folder
(``modeld/server/http/openai``, ...) is part of the HTTP room, ``bench/systems`` of ``bench``.

1. No import circle between files, nor between rooms, in ``modeld/``, ``runtime_client/`` and
   ``bench/``.
2. ``cache/`` imports neither ``engine/`` nor ``workers/`` (it owns the protocol it reaches a
   runtime through: ``modeld/cache/runtime.py``); ``engine/`` imports ``workers/`` only where it
   composes a model (:data:`ENGINE_TO_WORKERS`): the rest of the engine reads its own job and
   event types (``modeld/engine/jobs.py``), never a worker message.
3. ``engine/``, ``cache/``, ``backends/``, ``workers/`` and ``decoding/`` import no gRPC,
   protobuf or HTTP framework, nor the wire conversion.
4. An HTTP API's folder imports the shared HTTP layer only, never another API's folder, nor the
   app that composes them (``routes.py``, ``listener.py``); the shared layer imports no API; and
   every API's folder has the same files (adding an API is copying a folder).
5. The layout table of ``blueprints/README.md`` has a row for every room of ``modeld/`` and
   names nothing that does not exist, and each room imports only the rooms its row allows.
6. Every package has a caption (its docstring); a caption that names its modules (``x.py``)
   names every one, and only ones that exist.
7. Every file of ``modeld/``, ``runtime_client/`` and ``bench/`` stays under :data:`MAX_LINES`
   lines, except those named in :data:`KNOWN_LARGE` with the reason (each stated in its
   blueprint too); a named one that shrank under the budget leaves the list.
8. Every ``blueprints/NNNN...`` path, every ``tests/...py`` path and every path of a file in the
   code's own folders named in the code, the Makefile, the README or a blueprint exists (in
   tests, their docstrings and comments are read: their strings are data).
9. No product code (``modeld/``, ``runtime_client/``) says "issue N": the tracker is not part
   of the house, and its numbers do not tell a reader anything.
10. Every test file lives in a room: a folder of ``tests/`` named in :data:`TEST_ROOMS` (the
    one list of them, each with what it tests), never directly under ``tests/``; the other
    folders are :data:`NOT_ROOMS` (the helpers every room imports, recorded data); a room holds
    test files only, the helpers none; no two test files share a name (pytest imports them by
    it: the rooms are not packages); and the README's development section names every room.

An exception (``KNOWN_*``) names itself and why it stands.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "modeld"
SOURCES = ("modeld", "runtime_client", "bench")
"""The folders whose modules the import map reads."""

# --- exceptions (each names itself and why it stands) ------------------------------------------

KNOWN_ROOM_CIRCLES: set[tuple[str, ...]] = set()
KNOWN_MISSING_PATHS: set[tuple[str, str]] = set()
KNOWN_ISSUE_NUMBERS: set[str] = set()
KNOWN_PARTIAL_APIS: dict[str, str] = {
    "sglang": "the SGLang gateway's worker routes are GETs of the daemon's state: no request to parse",
    "ui": "the live page and the request records are GETs of the daemon's state: no request to parse",
}
"""HTTP API folders without some of :data:`API_FILES`, and why."""
MAX_LINES = 650
KNOWN_LARGE: dict[str, str] = {
    "modeld/contract.py": "the contract's types, read top to bottom by every backend (blueprints/0001)",
    "modeld/cache/tiers.py": "the RAM and disk tiers are one index under one lock (blueprints/0016)",
    "bench/agent_apis.py": "a benchmark program read top to bottom: systems, rounds, report (blueprints/0012)",
    "bench/speculation.py": "a benchmark program read top to bottom: systems, rounds, report (blueprints/0012)",
    "bench/fleet.py": "a benchmark program read top to bottom: systems, rounds, report (blueprints/0012)",
}
"""Files of :data:`MAX_LINES` lines or more, and why."""
TEST_ROOMS: dict[str, str] = {
    "agents": "the real coding agents (Claude Code, Codex CLI) unchanged, and long agent sessions",
    "backends": "the llama.cpp and OpenVINO backends beyond the contract, GGUF headers, probing, describe",
    "bench": "the benchmark program's analysis and its comparison against the committed run",
    "cache": "warm state: the choice, the pool, costs, tiers, the shared store, the budget, the KV layout",
    "client": "runtime_client: its tool loop, and across daemon restarts",
    "contract": "the contract suite, once per implementation (the ``harness`` fixture)",
    "decoding": "constraints, tool-call and reasoning formats: alone, on the engines, over HTTP",
    "engine": "the engine's pieces: text, reuse, chat templates and their environment, model changes",
    "grpc": "what only the gRPC wire can get wrong: streams, thread pools, foreign clients",
    "house": "the house rules, packaging, install, ``modeld serve``'s flags, the CLI, the demo, manifest, lease",
    "http": "every HTTP API through its vendor's SDK, access, the gateway's worker routes, the fleet",
    "models": "the generated test models (TINY, COPYING, TOOLS, the families) and speculation on COPYING",
    "observe": "status, metrics, request records, the live page, the hardware inventory",
    "workers": "the supervised worker process: crashes, health, the decode seam, chaos",
}
"""The folders of ``tests/`` that hold test files, and what each tests."""
NOT_ROOMS: dict[str, str] = {
    "helpers": "the helper modules every room imports by name (``tests/conftest.py`` puts them on the path)",
    "fixtures": "recorded data: the requests the real agents send, and the script that records them",
}
"""The other folders of ``tests/``."""

# --- the import map ----------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {
    _module_name(p): p
    for folder in SOURCES
    for p in sorted((ROOT / folder).rglob("*.py"))
    if not p.is_relative_to(PACKAGE / "v1")
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


PARTED = ("modeld.server.http", "bench")
"""Rooms whose subfolders are parts of them, not rooms: the HTTP APIs' folders (``openai/``,
``anthropic/``, ...) live in the HTTP room (their own rule is below); ``bench/`` is one
program, whose systems (``bench/systems/``) run its workloads."""


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


ROOMS = _rooms()


def test_the_import_map_is_read_from_the_source() -> None:
    """The map sees what the code imports, lazy imports included (a map that saw nothing would
    pass every rule below)."""
    assert {"modeld.cache.warm", "modeld.engine.session", "modeld.server.grpc.servicer"} <= set(MODULES)
    assert "modeld.cache.hold" in IMPORTS["modeld.engine.session"]
    assert "modeld.backends.llama_runtime" in IMPORTS["modeld.backends.llama"]  # inside load()
    assert "modeld.cache.eviction" in IMPORTS["modeld.cache.warm"]  # from modeld.cache import eviction
    assert room("modeld.server.http.app") == "modeld.server.http"
    assert room("modeld.server.http.openai.request") == "modeld.server.http"
    assert room("modeld.contract") == "modeld.contract"
    assert room("bench.systems.llama_server") == "bench"
    assert "modeld.contract" in IMPORTS["runtime_client.client"]
    assert "bench.direct" in IMPORTS["bench.agent_apis"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_between_files() -> None:
    assert cycles(IMPORTS) == []


def test_no_import_circle_between_rooms() -> None:
    found = {tuple(c) for c in cycles(ROOMS)}
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


ENGINE_TO_WORKERS = {
    "modeld.engine.model": "a loaded model is composed there: its supervised worker host, the Load "
    "it starts with, and a generate job read as the engine's events (GenerateCall)",
}
"""The modules of ``engine/`` that import ``workers/``, and why."""


def test_the_engine_imports_the_workers_only_where_it_composes_a_model() -> None:
    reaching = {
        module
        for module, targets in IMPORTS.items()
        if module.startswith("modeld.engine")
        and any(target.startswith("modeld.workers") for target in targets)
    }
    assert reaching == set(ENGINE_TO_WORKERS)


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


# --- the HTTP APIs: one shape, independent folders -----------------------------------------------

HTTP = "modeld.server.http"
HTTP_DIR = PACKAGE / "server" / "http"
COMPOSITION = {f"{HTTP}.routes", f"{HTTP}.listener"}
"""The app: the only modules of the HTTP room that put the APIs together."""
API_FILES = ("__init__.py", "request.py", "answer.py", "routes.py")
"""What every API's folder holds (and a store where the API has one)."""


def api_of(module: str) -> str | None:
    """The HTTP API folder a module lives in (``openai``, ...), None for the shared layer."""
    path = MODULES[module]
    if not path.is_relative_to(HTTP_DIR) or path.parent == HTTP_DIR:
        return None
    return path.relative_to(HTTP_DIR).parts[0]


def test_an_api_imports_the_shared_layer_only_and_the_shared_layer_no_api() -> None:
    """A folder per API, each talking only to the shared HTTP layer: no API reaches into
    another's folder or into the app that composes them, and nothing shared reaches into an API
    (only the app, ``routes.py``, imports them all)."""
    apis = {api_of(m) for m in MODULES} - {None}
    assert {"openai", "responses", "anthropic", "ollama", "sglang"} <= apis
    crossing = set()
    for module, targets in IMPORTS.items():
        if not module.startswith(HTTP + "."):
            continue
        mine = api_of(module)
        for target in targets:
            theirs = api_of(target) if target.startswith(HTTP + ".") else None
            if mine is not None and (theirs not in (None, mine) or target in COMPOSITION):
                crossing.add((module, target))
            if mine is None and theirs is not None and module not in COMPOSITION:
                crossing.add((module, target))
    assert crossing == set()


def test_every_api_folder_has_the_same_files() -> None:
    """Adding an API is copying a folder: each holds a request parser, its answers (and its
    Dialect) and its routes."""
    missing = {
        (folder.name, name)
        for folder in HTTP_DIR.iterdir()
        if (folder / "__init__.py").is_file()
        for name in API_FILES
        if not (folder / name).is_file() and folder.name not in KNOWN_PARTIAL_APIS
    }
    assert missing == set()
    for name in KNOWN_PARTIAL_APIS:
        assert (HTTP_DIR / name / "routes.py").is_file(), name


# --- the layout table --------------------------------------------------------------------------

LAYOUT_ROW = re.compile(r"^\| (`[^|]*`) \| [^|]* \| ([^|]*) \|$", re.MULTILINE)


def _top_level(cell: str) -> list[str]:
    """The comma-separated items of a cell, parentheses (and what they say) left out."""
    depth, out, word = 0, [], ""
    for char in cell:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            out.append(word)
            word = ""
        elif depth == 0 and char not in "()":
            word += char
    return [w.strip() for w in [*out, word] if w.strip()]


def _layout() -> dict[str, set[str] | None]:
    """Each room the table names -> the rooms its row lets it import (None: anything)."""
    table = (ROOT / "blueprints" / "README.md").read_text()
    rooms: dict[str, set[str] | None] = {}
    for named, allowed in LAYOUT_ROW.findall(table):
        own = [
            "modeld." + n.removesuffix("/").removesuffix(".py").replace("/", ".")
            for n in re.findall(r"`([^`]+)`", named)
        ]
        may: set[str] | None = set()
        for item in _top_level(allowed):
            word = item.split()[0].strip("`").removesuffix("/")
            if item.startswith("anything"):
                may = None
                break
            if item.startswith("each other"):
                may |= set(own)
            elif not item.startswith("nothing") and word != "runtime_client":
                may.add("modeld." + word.replace("/", "."))
        rooms.update(dict.fromkeys(own, may))
    return rooms


def test_the_layout_table_has_every_room_and_its_arrows() -> None:
    """``blueprints/README.md``'s table is the house's map: one row per room of ``modeld/``
    (every folder, every module at the top), nothing named that does not exist, and every arrow
    the code has is one its row allows."""
    layout = _layout()
    actual = {room(m) for m in MODULES if m.startswith("modeld.") and m != "modeld"} | {"modeld.v1"}
    assert set(layout) == actual
    unlisted = {
        (source, target)
        for source, targets in ROOMS.items()
        if source in layout and layout[source] is not None
        for target in targets
        if target.startswith("modeld.") and target not in (layout[source] or ()) and target != "modeld"
    }
    assert unlisted == set()


# --- captions and sizes ------------------------------------------------------------------------

MODULE_NAME = re.compile(r"``(\w+)\.py``")


def test_every_package_has_a_caption_that_names_what_is_there() -> None:
    """A package's docstring is its caption. One that names its modules (``x.py``) names all
    of them and only ones that exist (a stale list is how a newcomer gets lost)."""
    wrong = {}
    for module, path in MODULES.items():
        if path.name != "__init__.py":
            continue
        caption = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert caption, f"{module} has no caption"
        named = set(MODULE_NAME.findall(caption))
        present = {p.stem for p in path.parent.glob("*.py") if p.name != "__init__.py"}
        if named and named != present:
            wrong[module] = (sorted(named - present), sorted(present - named))
    assert wrong == {}


def test_files_keep_to_the_size_budget() -> None:
    """Files are split by job before they reach :data:`MAX_LINES` lines; the few that are not
    say why (:data:`KNOWN_LARGE`, and their blueprint)."""
    lines = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in MODULES.values()}
    large = {name for name, n in lines.items() if n >= MAX_LINES}
    assert large - set(KNOWN_LARGE) == set()
    assert set(KNOWN_LARGE) - large == set(), "a file named in KNOWN_LARGE is within the budget now"


# --- the tests' rooms --------------------------------------------------------------------------

TESTS = ROOT / "tests"


def test_every_test_file_lives_in_a_listed_room() -> None:
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(TEST_ROOMS) | set(NOT_ROOMS)
    assert sorted(p.name for p in TESTS.glob("*.py")) == ["conftest.py"]
    files = [p for p in TESTS.rglob("*.py") if not p.is_relative_to(TESTS / "fixtures")]
    misplaced = {
        str(p.relative_to(ROOT))
        for p in files
        if p.name != "conftest.py"
        and (p.parent.parent != TESTS or (p.parent.name in TEST_ROOMS) != p.name.startswith("test_"))
    }
    assert misplaced == set()
    names = [p.name for p in files if p.name.startswith("test_")]
    assert len(names) > 80
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_a_test_file_imports_test_modules_of_its_own_room_only() -> None:
    """pytest puts a test file's own folder on the path; another room's is there only when that
    room happened to be collected first."""
    across = {
        (str(path.relative_to(ROOT)), name)
        for path in TESTS.glob("*/test_*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        for name in (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        if name.startswith("test_") and not (path.parent / f"{name}.py").exists()
    }
    assert across == set()


def test_the_readme_names_every_room_of_the_tests() -> None:
    readme = (ROOT / "README.md").read_text()
    development = readme[readme.index("## Development") :]
    assert [r for r in TEST_ROOMS if f"`tests/{r}/`" not in development] == []


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
