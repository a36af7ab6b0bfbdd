"""The house's rules, read from the source (AST, nothing imported):

- Mooncake is imported by ``kvpool.store.mooncake`` and ``mooncake_setup`` only;
- vLLM by the adapter (``kvpool.vllm``) and the programs that run an engine (the
  demo's engine, and the CLI commands that check vLLM is installed) only: the core,
  the store, the lookup service, the pool and the benches import neither;
- nothing outside the adapter imports the adapter (ops read a connector through its
  public ``counters()``, engines load it by module path);
- kvpool's modules import each other without a cycle (imports at module level; an
  import inside a function or under ``TYPE_CHECKING`` is not a dependency at load).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import kvpool

ROOT = Path(kvpool.__file__).parent
MOONCAKE_USERS = {"kvpool.store.mooncake", "kvpool.store.mooncake_setup"}
VLLM_USERS = {"kvpool.demo.engine", "kvpool.cli.chaos_cmd", "kvpool.cli.demo_cmd"}
ADAPTER = "kvpool.vllm"


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(module: str) -> Iterator[tuple[str, bool]]:
    """(module imported, whether at load: module level, not under TYPE_CHECKING)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))

    def visit(node: ast.AST, at_load: bool) -> Iterator[tuple[str, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, at_load
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for alias in child.names:  # a submodule imported by name, or the package
                    sub = f"{base}.{alias.name}"
                    yield (sub if sub in MODULES else base), at_load
            else:
                yield from visit(child, at_load and not _deferred(child))

    yield from visit(tree, True)


def _deferred(node: ast.AST) -> bool:
    """Imports below ``node`` do not run when the module loads: a function's body,
    or a block under ``if TYPE_CHECKING``."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        return True
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _top(name: str) -> str:
    return name.split(".")[0]


def test_only_the_store_imports_mooncake() -> None:
    users = {m for m in MODULES for n, _ in _imports(m) if _top(n) == "mooncake"}
    assert users == MOONCAKE_USERS


def test_only_the_adapter_and_engine_programs_import_vllm() -> None:
    users = {m for m in MODULES for n, _ in _imports(m) if _top(n) == "vllm"}
    outside = {m for m in users if m != ADAPTER and not m.startswith(ADAPTER + ".")}
    assert outside == VLLM_USERS, outside ^ VLLM_USERS


def test_nothing_outside_the_adapter_imports_it() -> None:
    def inside(m: str) -> bool:
        return m == ADAPTER or m.startswith(ADAPTER + ".")

    users = {m for m in MODULES if not inside(m) for n, _ in _imports(m) if inside(n)}
    assert not users


def test_modules_import_each_other_without_a_cycle() -> None:
    graph = {
        m: {n for n, at_load in _imports(m) if at_load and n in MODULES and n != m} for m in MODULES
    }
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def walk(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (cycle := walk(n)):
                return cycle
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (cycle := walk(m)):
            raise AssertionError(" -> ".join(cycle))


def test_the_rules_see_imports_at_all() -> None:
    """The reader finds what it must (a reader that found nothing would pass)."""
    assert ("mooncake.store", False) in set(_imports("kvpool.store.mooncake_setup"))
    assert ("kvpool.connector.worker", True) in set(_imports("kvpool.vllm.worker"))
    assert len(MODULES) > 100
