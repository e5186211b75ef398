"""The package's modules point down only: no import cycle among them, and the face (__init__)
imported by none. Read from the source with ast, every import statement counted wherever it
is (module level or inside a function), relative or through the absolute name "gradsync";
nothing of the package (or torch) is imported."""
import ast
import os

from conftest import ROOT

PACKAGE = "gradsync"
PACKAGE_DIR = os.path.join(ROOT, "client", "python", PACKAGE)


def module_name(fname):
    """The dotted name of a file of the package ("gradsync" for __init__.py)."""
    stem = fname[:-len(".py")]
    return PACKAGE if stem == "__init__" else f"{PACKAGE}.{stem}"


def imported(name, node, modules):
    """The modules of the package an import statement in module `name` reaches: a submodule
    named, or the face when a name is taken from the package itself."""
    out = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                out.append(alias.name)
        return [m for m in out if m in modules]
    if node.level:  # relative: from the package this module is in (or above it)
        package = name if name == PACKAGE else name.rsplit(".", 1)[0]
        parts = package.split(".")
        base = ".".join(parts[:len(parts) - (node.level - 1)])
        target = base + (f".{node.module}" if node.module else "")
    else:
        target = node.module or ""
    if target != PACKAGE and not target.startswith(PACKAGE + "."):
        return []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        out.append(sub if sub in modules else target)  # a submodule, else a name of target
    return [m for m in out if m in modules]


def import_graph(package_dir):
    """{module: set of the package's modules it imports} for every .py file of the package."""
    files = sorted(f for f in os.listdir(package_dir) if f.endswith(".py"))
    modules = {module_name(f) for f in files}
    graph = {}
    for fname in files:
        name = module_name(fname)
        with open(os.path.join(package_dir, fname)) as f:
            tree = ast.parse(f.read(), fname)
        graph[name] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name].update(m for m in imported(name, node, modules) if m != name)
    return graph


def find_cycle(graph):
    """One cycle of the graph as a list of modules (first == last), or None."""
    state = {}  # module -> 1 while on the path, 2 once every path from it was explored
    path = []

    def visit(module):
        state[module] = 1
        path.append(module)
        for nxt in sorted(graph.get(module, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def edges(graph):
    return "\n".join(f"  {a} -> {b}" for a in sorted(graph) for b in sorted(graph[a]))


def test_the_package_has_no_import_cycle():
    graph = import_graph(PACKAGE_DIR)
    assert {PACKAGE, f"{PACKAGE}._native", f"{PACKAGE}.elastic", f"{PACKAGE}.torch"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}\nthe graph:\n{edges(graph)}"


def test_no_module_of_the_package_imports_its_face():
    graph = import_graph(PACKAGE_DIR)
    importers = sorted(m for m, targets in graph.items() if PACKAGE in targets)
    assert importers == [], f"{importers} import {PACKAGE}/__init__.py\nthe graph:\n{edges(graph)}"


def test_the_check_sees_every_form_of_import(tmp_path):
    """A cycle through a deferred import, an absolute "gradsync.x" and a name of the face is
    each found: the checks above are not vacuous."""
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import a\nfrom .a import thing\n")
    (pkg / "a.py").write_text("import os\n\ndef f():\n    from . import b\n")
    (pkg / "b.py").write_text("import gradsync.c\n")
    (pkg / "c.py").write_text("from gradsync import thing\n")
    graph = import_graph(str(pkg))
    assert graph == {"gradsync": {"gradsync.a"}, "gradsync.a": {"gradsync.b"},
                     "gradsync.b": {"gradsync.c"}, "gradsync.c": {"gradsync"}}
    assert find_cycle(graph) == ["gradsync", "gradsync.a", "gradsync.b", "gradsync.c",
                                 "gradsync"]
    (pkg / "c.py").write_text("import torch\n")
    assert find_cycle(import_graph(str(pkg))) is None
