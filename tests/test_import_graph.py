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


# What docs/design.md calls the pure core: the schedule, its simulator and models, the flags,
# their one validator, the methods' configuration side, the projections. No torch, no Megatron.
PURE_CORE = ("paci_megatron.adapt", "paci_megatron.arguments", "paci_megatron.config",
             "paci_megatron.emulate", "paci_megatron.executor", "paci_megatron.features",
             "paci_megatron.flag", "paci_megatron.interleaved", "paci_megatron.layer_split",
             "paci_megatron.lockstep",
             "paci_megatron.nccl_model", "paci_megatron.plan_policy", "paci_megatron.registry",
             "paci_megatron.restart", "paci_megatron.schedule", "paci_megatron.shape",
             "paci_megatron.simulate", "paci_megatron.throughput", "paci_megatron.tools.compare",
             "paci_megatron.tools.tta")
HEAVY = ("torch", "megatron", "transformer_engine", "apex")


class _Refuse:
    """A meta-path finder that makes importing the heavy packages fail, so that an import of
    the pure core that reaches one of them raises, naming it."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HEAVY:
            raise ImportError(f"the pure core imported {name}")
        return None


def test_the_pure_core_imports_neither_torch_nor_megatron():
    """Each pure module imported afresh, in this process, with torch and Megatron made
    unimportable (the modules this test process already holds are put back after)."""
    import importlib
    import sys

    saved = dict(sys.modules)
    refuse = _Refuse()
    try:
        for name in list(sys.modules):
            if name.split(".")[0] in HEAVY + ("paci_megatron",):
                del sys.modules[name]
        sys.meta_path.insert(0, refuse)
        for module in PURE_CORE:
            importlib.import_module(module)
        heavy = sorted(n for n in sys.modules if n.split(".")[0] in HEAVY)
    finally:
        sys.meta_path.remove(refuse)
        sys.modules.clear()
        sys.modules.update(saved)
    assert heavy == []


# The layers that read the flags as parsed (the entry points' adapters, the one validator
# and the methods' configuration side, the tools' own command lines); below them, the run's
# config objects only.
ADAPTERS = ("paci_megatron.arguments", "paci_megatron.config", "paci_megatron.run",
            "paci_megatron.training", "paci_megatron.flag")
# the Megatron-LM drop-in's adapter (patches/megatron_lm/ as a whole), every method's
# configuration side (features/: check, settings, off_note read the flags) and each tool's CLI
ADAPTER_PACKAGES = ("paci_megatron.patches.megatron_lm", "paci_megatron.features",
                    "paci_megatron.tools.")
FLAG_NAMES = {"args", "margs"}


def _reads_flags(path):
    """(line, what) for each function of the file that takes the parsed flags or reads a
    ``.args`` attribute (a torch hook's positional ``args`` is not the flags)."""
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = {a.arg for a in node.args.args + node.args.kwonlyargs}
            hook = "module" in names or node.name.startswith("__torch_")  # torch's protocols
            if names & FLAG_NAMES and not hook:
                found.append((node.lineno, f"{node.name}({', '.join(names & FLAG_NAMES)})"))
        elif isinstance(node, ast.Attribute) and node.attr in FLAG_NAMES \
                and isinstance(node.value, ast.Name) and node.value.id == "job":
            found.append((node.lineno, f"job.{node.attr}"))
    return found


def test_nothing_below_the_adapters_reads_the_parsed_flags():
    below = {m: path for m, (path, _pkg) in _modules().items()
             if m not in ADAPTERS and not m.startswith(ADAPTER_PACKAGES)}
    readers = {m: _reads_flags(path) for m, path in below.items()}
    assert {m: r for m, r in readers.items() if r} == {}


def test_the_flag_reader_check_sees_a_reader(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f(args):\n    return args.lr\n\ndef g(job):\n    return job.args\n"
                      "\ndef hook(module, args, output):\n    return output\n"
                      "\ndef __torch_function__(cls, func, types, args=(), kwargs=None):\n"
                      "    return func\n")
    assert _reads_flags(str(source)) == [(1, "f(args)"), (5, "job.args")]
