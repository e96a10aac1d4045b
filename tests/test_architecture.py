"""Dependencies point one way: gui and server -> core -> store, and modules stay small. Checked on
the source, so a new import in the wrong direction or a module past its size fails here rather
than in a code review."""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parent.parent / "app"
CORE = ("store", "tasks", "engine", "core")
QT = ("PySide6", "shiboken6", "qasync")


def imports(folder: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for file in (APP / folder).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        found[str(file.relative_to(APP))] = names
    return found


def offenders(folders: tuple[str, ...], banned: tuple[str, ...]) -> list[str]:
    return sorted(f"{file}: {name}" for folder in folders for file, names in imports(folder).items()
                  for name in names if name.split(".")[0] in banned or name.startswith(banned))


def test_the_core_imports_neither_qt_nor_aiohttp() -> None:
    assert offenders(CORE, (*QT, "aiohttp")) == []


def test_the_server_imports_no_qt_and_the_gui_no_server() -> None:
    assert offenders(("server",), QT) == []
    assert offenders(("gui",), ("aiohttp", "app.server")) == []


def test_the_surfaces_import_only_the_core_and_the_ground_floor() -> None:
    """server/ and gui/ translate (HTTP, widgets) and call the core: the store, the tasks and the
    engine are reached through it, so a rule lives in one place for every surface."""
    assert offenders(("server", "gui"), ("app.store", "app.tasks", "app.engine")) == []


def test_the_gui_reaches_state_only_through_the_facade() -> None:
    """No SQL from the GUI: not the store, not the engine, not the scheduler."""
    assert offenders(("gui",), ("sqlite3", "app.store", "app.engine", "app.tasks.scheduler", "app.tasks.kinds",
                                "app.tasks.machine", "app.tasks.records")) == []


# The floors, lowest first: a module imports from its own floor and those below, never above.
FLOORS = [("errors", "paths", "durable", "secrets", "events", "logs", "display", "resources"), ("store",), ("engine",),
          ("tasks",), ("core",), ("server", "gui"), ("main", "cli", "__main__")]


def floor(module: str) -> int:
    """The floor of `app.x...` (or of a file's path below app/, as `x/...`)."""
    top = module.removeprefix("app.").split(".")[0].split("/")[0].removesuffix(".py")
    return next(i for i, names in enumerate(FLOORS) if top in names)


def test_no_module_imports_from_a_floor_above_its_own() -> None:
    """The order errors/paths/secrets/events < store < engine < tasks < core < server, gui < main.
    The event bus lives on the ground floor: the engine reported to it from below tasks/."""
    upward = sorted(f"{file}: {name}" for file, names in imports("").items() if file != "__init__.py"
                    for name in names if name.startswith("app.") and floor(name) > floor(file))
    assert upward == []
    assert offenders(("server",), ("app.gui",)) == [] and offenders(("gui",), ("app.server",)) == []


# Modules stay readable: a module past this is asking to be split along a seam it already has.
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60
# A longer function says why on the line above its `def` (or above its first decorator).
LONG_REASON = "# long:"
# Modules and functions allowed to stay long (none now): a new one is split, not listed.
KNOWN_LONG_MODULES: set[str] = set()
KNOWN_LONG_FUNCTIONS: set[str] = set()


def sources() -> dict[str, str]:
    return {str(file.relative_to(APP)): file.read_text(encoding="utf-8") for file in sorted(APP.rglob("*.py"))}


def long_functions(name: str, text: str) -> list[str]:
    lines = text.splitlines()
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            said_why = first > 1 and lines[first - 2].strip().startswith(LONG_REASON)
            if length > MAX_FUNCTION_LINES and not said_why:
                found.append(f"{name}: {node.name}")
    return found


def test_no_module_is_over_450_lines() -> None:
    long = {name for name, text in sources().items() if len(text.splitlines()) > MAX_MODULE_LINES}
    assert long - KNOWN_LONG_MODULES == set(), "split along a seam the module already has"
    assert KNOWN_LONG_MODULES - long == set(), "split now: take them off KNOWN_LONG_MODULES"


def test_no_function_is_over_60_lines_without_saying_why() -> None:
    long = {found for name, text in sources().items() for found in long_functions(name, text)}
    assert long - KNOWN_LONG_FUNCTIONS == set(), f"shorten them, or say why above the def ({LONG_REASON} ...)"
    assert KNOWN_LONG_FUNCTIONS - long == set(), "short now: take them off KNOWN_LONG_FUNCTIONS"
