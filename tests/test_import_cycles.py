"""No import cycles (issue 25.4), read from the source (tests/import_graph.py; `python
tests/import_graph.py` prints them): no two modules import each other, directly or round a loop;
the layers import only those below them (pallas_kernels < meshes < models < jaxtrain); and
jaxtrain's subpackages form no loop but for the edges listed below, each still to be cut. A
listed edge that is gone must leave the list, so it only shrinks."""
import pytest

from import_graph import PACKAGES, cycles, edges_within, module_graph, package_graph, package_of

pytestmark = [pytest.mark.fast]

# Module cycles not yet cut: (modules of the cycle, why / what cuts it).
KNOWN_MODULE_CYCLES = {
}

# Package edges that still close a loop: (importer, imported) -> why / what cuts it.
KNOWN_PACKAGE_EDGES = {
    ("jaxtrain.pipeline", "jaxtrain.training"):
        "the stage layout and staged state build on training/state.py (init_state, map_param_leaves, "
        "optimizer_shardings ...), while train_setup assembles the pipeline",
}


@pytest.fixture(scope="module")
def graph():
    return module_graph()


def test_no_module_imports_itself_round_a_loop(graph):
    found = {tuple(c): edges_within(graph, c) for c in cycles(graph)}
    new = {c: e for c, e in found.items() if c not in KNOWN_MODULE_CYCLES}
    assert not new, "import cycles between modules:\n" + "\n".join(f"{c}: {e}" for c, e in new.items())
    gone = [c for c in KNOWN_MODULE_CYCLES if c not in found]
    assert not gone, f"cut, so take them out of KNOWN_MODULE_CYCLES: {gone}"


def test_each_layer_imports_only_the_layers_below_it(graph):
    rank = {package: i for i, package in enumerate(PACKAGES)}
    upward = sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs
                    if rank[b.split(".")[0]] > rank[a.split(".")[0]])
    assert not upward, f"imports of a higher layer ({' < '.join(PACKAGES)}): {upward}"


def test_packages_form_no_loop_but_the_known_edges(graph):
    packages = package_graph(graph)
    missing = [edge for edge in KNOWN_PACKAGE_EDGES if edge[1] not in packages.get(edge[0], ())]
    assert not missing, f"no longer imported, so take them out of KNOWN_PACKAGE_EDGES: {missing}"
    cut = {a: {b for b in bs if (a, b) not in KNOWN_PACKAGE_EDGES} for a, bs in packages.items()}
    loops = cycles(cut)
    assert not loops, "import loops between packages (each with the module imports behind it):\n" + "\n".join(
        f"{c}: {edges_within(graph, c, package_of)}" for c in loops)
