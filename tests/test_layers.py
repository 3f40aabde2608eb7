"""The package's layers, checked from its source: every import goes downward in

    data, ops (+ reference) -> engines -> models -> scheduling -> decoding -> methods -> train -> cli

and no two modules import each other, directly or through others. A planted upward
import shows that the check can fail."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "flashspark"
LAYERS = ["data", "ops", "reference", "engines", "models", "scheduling", "decoding", "methods", "train", "cli"]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path, source: str | None = None) -> list[tuple[str, int]]:
    """(imported flashspark module, line) for every import in the file, at any depth."""
    mod = module_name(path, root)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source if source is not None else path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                prefix = ".".join(base)
                if node.module:
                    found.append((f"{prefix}.{node.module}", node.lineno))
                else:
                    found += [(f"{prefix}.{a.name}", node.lineno) for a in node.names]
            elif node.module:
                found.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
    return [(m, line) for m, line in found if m.startswith("flashspark.")]


def layer(mod: str) -> int | None:
    parts = mod.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def upward_imports(root: Path, planted: dict[str, str] | None = None) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        source = (planted or {}).get(path.name)
        mod = module_name(path, root)
        for target, line in imports_of(path, root, source):
            if layer(mod) is not None and layer(target) is not None and layer(target) > layer(mod):
                bad.append(f"{mod}:{line} imports {target}")
    return bad


def test_imports_go_downward_only():
    assert upward_imports(PACKAGE) == []


def test_a_planted_upward_import_is_found():
    plain = (PACKAGE / "decoding" / "plain.py").read_text() + "\nfrom ..cli import main\n"
    assert any("imports flashspark.cli" in b for b in upward_imports(PACKAGE, {"plain.py": plain}))


def resolve(mod: str, modules: set[str]) -> str | None:
    """The module an import names (an imported name of a package resolves to the package)."""
    while mod and mod not in modules:
        mod = mod.rsplit(".", 1)[0] if "." in mod else ""
    return mod or None


def test_no_import_cycles():
    files = {module_name(p, PACKAGE): p for p in PACKAGE.rglob("*.py")}
    graph = {m: set() for m in files}
    for mod, path in files.items():
        for target, _ in imports_of(path, PACKAGE):
            t = resolve(target, set(files))
            # a package's __init__ re-exporting its own modules is not a cycle of layers
            if t and t != mod and not mod.startswith(t + ".") and not t.startswith(mod + "."):
                graph[mod].add(t)
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(m: str, stack: list[str]) -> bool:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle.extend(stack[stack.index(t) :] + [m, t] if t in stack else [m, t])
                return True
            if state.get(t) is None and visit(t, stack + [t]):
                return True
        state[m] = 2
        return False

    for m in sorted(graph):
        if state.get(m) is None and visit(m, [m]):
            break
    assert not cycle, " -> ".join(cycle)


@pytest.mark.parametrize("name", ["spec"])
def test_no_folder_named_after_tests(name):
    assert not (PACKAGE / name).exists()


def unexplained_function_imports(root: Path, planted: dict[str, str] | None = None) -> list[str]:
    """Imports inside functions whose line carries no comment saying why (a cycle broken, a
    costly optional import): every other import belongs at the top of its module."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        source = (planted or {}).get(path.name) or path.read_text()
        lines = source.splitlines()
        for fn in ast.walk(ast.parse(source)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and "#" not in lines[node.lineno - 1]:
                    bad.append(f"{module_name(path, root)}:{node.lineno}")
    return bad


def test_imports_inside_functions_say_why():
    assert unexplained_function_imports(PACKAGE) == []


def test_a_planted_function_import_is_found():
    plain = (PACKAGE / "decoding" / "plain.py").read_text() + "\n\ndef late():\n    import json\n"
    assert unexplained_function_imports(PACKAGE, {"plain.py": plain}) != []
