"""The layers hold: no package reaches into another's private names (imported,
or read as an attribute), and only `_loop` writes a loop's fields (others
call its named methods).

A *unit* is a first-level entry of `agentfsm/` (`_loop`, `store`, `tools`,
`mcp`, ...). A unit may import from another only names that do not start with
an underscore, through modules that do not either (`agentfsm._loop.loop.Loop`
is fine, `agentfsm.store._sql.SQLStore` or `tools._current_call` is not); the
top-level private helpers (`agentfsm._text`, ...) are units of their own.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

import agentfsm
from agentfsm._bus import Emitter
from agentfsm._loop import Loop

ROOT = Path(agentfsm.__file__).parent

ALLOWED: frozenset[tuple[str, str]] = frozenset()
"""(module, what) pairs let through: none."""

LOOP_FIELDS: frozenset[str] = frozenset(
    name
    for cls in Loop.__mro__
    if cls in (Loop, Emitter)
    for name in getattr(cls, "__slots__", ())
)


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_module(dotted: str) -> bool:
    path = ROOT.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _resolved(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def private_imports(module: str, tree: ast.Module, is_package: bool) -> Iterator[str]:
    """What `module` takes from another unit's private names."""
    unit = _unit(module)
    modules: dict[str, str] = {}  # local name -> dotted module of another unit
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolved(module, is_package, node)
            if target.split(".")[0] != "agentfsm":
                continue
            for alias in node.names:
                dotted = f"{target}.{alias.name}"
                parts = dotted.split(".")
                if _unit(dotted) == unit:
                    continue
                if any(_private(p) for p in parts[2:]):
                    yield f"line {node.lineno}: {dotted}"
                elif _is_module(dotted):
                    modules[alias.asname or alias.name] = dotted
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] != "agentfsm" or _unit(alias.name) == unit:
                    continue
                if any(_private(p) for p in parts[2:]):
                    yield f"line {node.lineno}: {alias.name}"
                elif alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and _private(node.attr)
        ):
            yield f"line {node.lineno}: {modules[node.value.id]}.{node.attr}"


def private_definitions(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Each private name a unit defines (a function, class, module global,
    attribute or slot), with the units that define it."""
    defined: dict[str, set[str]] = {}

    def add(name: str, unit: str) -> None:
        if _private(name):
            defined.setdefault(name, set()).add(unit)

    for module, tree in trees.items():
        unit = _unit(module)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                add(node.name, unit)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = (
                    node.targets if isinstance(node, ast.Assign) else [node.target]
                )
                for target in targets:
                    for part in ast.walk(target):
                        if isinstance(part, ast.Attribute):
                            add(part.attr, unit)
                        elif isinstance(part, ast.Name):
                            add(part.id, unit)
                        if isinstance(part, ast.Name) and part.id == "__slots__":
                            for slot in ast.walk(node.value or ast.Tuple(elts=[])):
                                if isinstance(slot, ast.Constant) and isinstance(
                                    slot.value, str
                                ):
                                    add(slot.value, unit)
    return defined


def private_reads(
    module: str, tree: ast.Module, defined: dict[str, set[str]]
) -> Iterator[str]:
    """Attributes `module` reads (`runtime._loops`, `agentfsm.tools._x`) whose
    private name only other units define (a name no unit defines is another
    library's, not this check's)."""
    unit = _unit(module)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        base = ast.unparse(node.value)
        if base in ("self", "cls") or base.startswith("super("):
            continue
        owners = defined.get(node.attr)
        if owners and unit not in owners:
            yield f"line {node.lineno}: {ast.unparse(node)}"


def _loop_names(function: ast.AST) -> set[str]:
    """Parameters of `function` annotated as a `Loop`."""
    names: set[str] = set()
    if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
        arguments = function.args
        for arg in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs):
            if arg.annotation is not None and ast.unparse(arg.annotation) in (
                "Loop",
                "'Loop'",
            ):
                names.add(arg.arg)
    return names


def _is_loop(expression: ast.expr, annotated: set[str]) -> bool:
    text = ast.unparse(expression)
    return text in annotated or text.lower().endswith("loop")


def _written(target: ast.expr) -> Iterator[ast.Attribute]:
    """The attributes an assignment to `target` writes (a subscript writes
    into what it indexes, not into its index)."""
    if isinstance(target, ast.Attribute):
        yield target
    elif isinstance(target, ast.Tuple | ast.List):
        for element in target.elts:
            yield from _written(element)
    elif isinstance(target, ast.Starred | ast.Subscript):
        yield from _written(target.value)


def loop_writes(tree: ast.Module) -> Iterator[str]:
    """Assignments to a `Loop`'s fields (and `setattr` on a loop)."""
    scopes: list[tuple[ast.AST, set[str]]] = [(tree, set())]
    for function in ast.walk(tree):
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            scopes.append((function, _loop_names(function)))
    found: dict[tuple[int, str], None] = {}
    for scope, annotated in scopes:
        for node in ast.walk(scope):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign | ast.Delete):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            for target in targets:
                for part in _written(target):
                    if part.attr in LOOP_FIELDS and _is_loop(part.value, annotated):
                        found[part.lineno, ast.unparse(part)] = None
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) in ("setattr", "object.__setattr__")
                and node.args
                and _is_loop(node.args[0], annotated)
            ):
                found[node.lineno, ast.unparse(node)] = None
    for line, what in found:
        yield f"line {line}: {what}"


@functools.cache
def _trees() -> dict[str, tuple[Path, ast.Module]]:
    """Every module of `agentfsm/`, parsed once."""
    return {
        _module_of(path): (path, ast.parse(path.read_text()))
        for path in sorted(ROOT.rglob("*.py"))
    }


def test_no_unit_imports_a_private_name_of_another() -> None:
    found = [
        f"{module} {what}"
        for module, (path, tree) in _trees().items()
        for what in private_imports(module, tree, path.name == "__init__.py")
        if (module, what.split(": ", 1)[1]) not in ALLOWED
    ]
    assert not found, "private names taken across units:\n" + "\n".join(found)


def test_no_unit_reads_a_private_attribute_of_another() -> None:
    trees = {module: tree for module, (_, tree) in _trees().items()}
    defined = private_definitions(trees)
    found = [
        f"{module} {what}"
        for module, tree in trees.items()
        for what in private_reads(module, tree, defined)
        if (module, what.split(": ", 1)[1]) not in ALLOWED
    ]
    assert not found, "private attributes read across units:\n" + "\n".join(found)


def test_only_the_loop_package_writes_a_loops_fields() -> None:
    found = [
        f"{module} {what}"
        for module, (_, tree) in _trees().items()
        if not module.startswith("agentfsm._loop")
        for what in loop_writes(tree)
        if (module, what.split(": ", 1)[1]) not in ALLOWED
    ]
    assert not found, "loop fields written outside _loop:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("agentfsm.cli.x", "from agentfsm.store._sql import SQLStore", 1),
        ("agentfsm.cli.x", "from agentfsm.tools import _current_call", 1),
        ("agentfsm.cli.x", "from agentfsm import tools\ntools._current_call", 1),
        ("agentfsm.cli.x", "import agentfsm.store._sql", 1),
        ("agentfsm.store.x", "from ._sql import SQLStore", 0),
        ("agentfsm.cli.x", "from agentfsm.store import SQLStore", 0),
        ("agentfsm.cli.x", "from agentfsm import _models\n_models.trusted", 0),
    ],
)
def test_the_import_check_sees_a_private_name(
    module: str, source: str, expected: int
) -> None:
    assert len(list(private_imports(module, ast.parse(source), False))) == expected


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("loop.journal = j", 1),
        ("self.loop.state = s", 1),
        ("def f(held: Loop) -> None:\n    held.handlers = ()", 1),
        ("setattr(loop, 'worker', w)", 1),
        ("loop.worker, x = w, 1", 1),
        ("loop.attach(j)", 0),
        ("loop.path[0] = step", 1),
        ("loops[loop.loop_id] = loop", 0),
        ("object.__setattr__(loop, 'state', s)", 1),
        ("ticket.error = e", 0),
    ],
)
def test_the_write_check_sees_a_loop_field(source: str, expected: int) -> None:
    assert len(list(loop_writes(ast.parse(source)))) == expected


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("agentfsm.ui", "runtime._loops.get(loop_id)", 1),
        ("agentfsm.cli.x", "import agentfsm.tools\nagentfsm.tools._current_call", 1),
        ("agentfsm._runtime.x", "runtime._loops", 0),  # its own unit's
        ("agentfsm.ui", "self._loops", 0),
        ("agentfsm.ui", "trace._TRACER_PROVIDER", 0),  # no unit defines it
    ],
)
def test_the_attribute_check_sees_a_private_read(
    module: str, source: str, expected: int
) -> None:
    defined = {"_loops": {"_runtime"}, "_current_call": {"tools"}}
    reads = list(private_reads(module, ast.parse(source), defined))
    assert len(reads) == expected
