"""The package's import graph, read from the source (no import runs): no module imports one
that imports it back, directly or around a circle, wherever the import stands (top of the file,
inside a function, under TYPE_CHECKING). ``patches/`` is installed as
``paci_megatron.patches`` (setup.py), so it is read under that name."""

import ast
import os

from launch import REPO

ROOTS = {"paci_megatron": os.path.join(REPO, "paci_megatron"),
         "paci_megatron.patches": os.path.join(REPO, "patches")}


def _modules():
    found = {}
    for package, folder in ROOTS.items():
        for dirpath, _dirs, files in os.walk(folder):
            for name in files:
                if not name.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, name), folder)[:-3]
                parts = [p for p in rel.split(os.sep) if p != "__init__"]
                dotted = ".".join([package, *parts])
                is_package = name == "__init__.py"
                found[dotted] = (os.path.join(dirpath, name), is_package)
    return found


def _imports(dotted, path, is_package, known):
    """The package's own modules that ``dotted`` imports."""
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), path)
    base = dotted.split(".") if is_package else dotted.split(".")[:-1]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            stem = node.module or ""
            if node.level:
                up = base[:len(base) - node.level + 1]
                stem = ".".join(up + ([stem] if stem else []))
            names = [stem] + [f"{stem}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.startswith("patches."):  # the source checkout's name for the same folder
                name = "paci_megatron." + name
            if name in known and name != dotted:
                targets.add(name)
    return targets


def import_graph():
    modules = _modules()
    graph = {m: _imports(m, path, pkg, modules) for m, (path, pkg) in modules.items()}
    # a package's __init__ re-exporting its modules is its face, not a dependency of theirs
    return {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in graph.items()}


def circles(graph):
    """Every strongly connected group of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_reader_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    assert "paci_megatron.patches.release_check" in graph["paci_megatron.patches.cpu_gloo"]
    assert "paci_megatron.schedule" in graph["paci_megatron.simulate"]


def test_the_package_has_no_import_circle():
    assert circles(import_graph()) == []
