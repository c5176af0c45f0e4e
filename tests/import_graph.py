"""The import graph of the code packages, read from the source with `ast` (nothing is imported).

Every `import` / `from ... import` counts, at any depth (a function's lazy import is a dependency
too, only deferred). `from a.b import c` is an edge to `a.b.c` when that is a module, else to
`a.b`. `__main__.py` shims are entry points nothing imports, so they are left out.

    python tests/import_graph.py       prints the cycles: modules, then packages
"""
from __future__ import annotations

import ast
import os
from collections import defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("pallas_kernels", "meshes", "models", "jaxtrain")  # the layers' folders, lowest first (ARCHITECTURE.md)
# Each folder's import name: the model layers are imported under jaxtrain's name (jaxtrain/__init__.py).
IMPORT_NAMES = {folder: f"jaxtrain.{folder}" for folder in PACKAGES[:-1]} | {"jaxtrain": "jaxtrain"}
# Top-level names the layers had before they moved under jaxtrain's: importing one would load a
# second copy of a module (a second registry, classes that are not the same classes).
STALE_NAMES = PACKAGES[:-1]


def layer_of(module: str) -> str:
    """The layer (folder) of a dotted module name."""
    for folder in PACKAGES[:-1]:
        name = IMPORT_NAMES[folder]
        if module == name or module.startswith(name + "."):
            return folder
    return "jaxtrain"


def modules(repo: str = REPO) -> dict[str, str]:
    """dotted module name -> file, over PACKAGES."""
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(repo, package)):
            for name in files:
                if name.endswith(".py") and name != "__main__.py":
                    path = os.path.join(folder, name)
                    dotted = os.path.relpath(path, os.path.join(repo, package))[:-3].replace(os.sep, ".")
                    dotted = f"{IMPORT_NAMES[package]}.{dotted}".removesuffix(".__init__")
                    found[dotted] = path
    return found


def module_graph(repo: str = REPO) -> dict[str, set[str]]:
    """module -> the modules of PACKAGES it imports."""
    known = modules(repo)

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in known}
    for module, path in known.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, up level - 1
                    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{base}" if base else package
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] == "jaxtrain":
                    resolved = resolve(target)
                    if resolved and resolved != module:
                        graph[module].add(resolved)
    return graph


def package_of(module: str) -> str:
    """The unit of the package-level graph: jaxtrain's subpackages (jaxtrain.training, ...) and
    top-level modules (jaxtrain.api), models.layers apart from models, and the other layers whole."""
    layer = layer_of(module)
    if layer == "jaxtrain":
        return ".".join(module.split(".")[:2])
    layers = f"{IMPORT_NAMES['models']}.layers"
    if module == layers or module.startswith(layers + "."):
        return layers
    return IMPORT_NAMES[layer]


def stale_imports(roots=("jaxtrain", "models", "meshes", "pallas_kernels", "tests", "benchmarks"),
                  repo: str = REPO) -> list[str]:
    """'file:line: name' for each import of a STALE_NAMES module under `roots`."""
    found = []
    for root in roots:
        for folder, _, files in os.walk(os.path.join(repo, root)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                with open(path) as f:
                    tree = ast.parse(f.read(), path)
                for node in ast.walk(tree):
                    names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                             [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module
                             else [])
                    found += [f"{os.path.relpath(path, repo)}:{node.lineno}: {n}" for n in names
                              if n.split(".")[0] in STALE_NAMES]
    return found


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for module, imported in graph.items():
        out[package_of(module)]
        for other in imported:
            if package_of(other) != package_of(module):
                out[package_of(module)].add(package_of(other))
    return dict(out)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def edges_within(graph: dict[str, set[str]], group: list[str], unit=lambda node: node) -> list[str]:
    """'a -> b' for each edge of `graph` between two different members of `group` (nodes mapped
    by `unit`: package_of to name the module imports behind a package cycle)."""
    members = set(group)
    return sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs
                  if unit(a) in members and unit(b) in members and unit(a) != unit(b))


if __name__ == "__main__":
    g = module_graph()
    for title, graph, unit in (("module", g, lambda m: m), ("package", package_graph(g), package_of)):
        print(f"{title} cycles:")
        for c in cycles(graph):
            print("  ", ", ".join(c))
            for edge in edges_within(g, c, unit):
                print("      ", edge)
