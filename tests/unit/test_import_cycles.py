"""No two modules of the package import each other, directly or around a circle, at module level (imports
under `if TYPE_CHECKING:` included): such a circle works only in some import orders."""

from __future__ import annotations

import ast
from pathlib import Path

import dapo_megatron

PACKAGE = Path(dapo_megatron.__file__).parent


def module_name(package: Path, path: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_level_imports(tree: ast.Module) -> set[str]:
    """Absolute names imported by the module's own statements (and `if`/`try` blocks), not inside
    functions."""
    names: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)

    visit(tree.body)
    return names


def import_graph(package: Path) -> dict[str, set[str]]:
    modules = {module_name(package, path): path for path in package.rglob("*.py")}
    return {
        name: {
            other
            for other in module_level_imports(ast.parse(path.read_text()))
            if other in modules and other != name
        }
        for name, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each circle once, as the path that closes it (depth-first search)."""
    found, state = [], dict.fromkeys(graph, 0)  # 0 unseen, 1 on the current path, 2 done
    path: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        path.append(node)
        for other in sorted(graph[node]):
            if state[other] == 1:
                found.append([*path[path.index(other) :], other])
            elif state[other] == 0:
                walk(other)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if state[node] == 0:
            walk(node)
    return found


def test_the_search_finds_a_circle_through_a_type_checking_import(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import B\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n"
    )
    assert cycles(import_graph(package)) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_the_package_has_no_import_circle() -> None:
    assert cycles(import_graph(PACKAGE)) == []
