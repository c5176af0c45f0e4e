"""No import cycles (issue 25.4), read from the source (tests/import_graph.py; `python
tests/import_graph.py` prints them): no two modules import each other, directly or round a loop;
the layers import only those below them (pallas_kernels < meshes < models < jaxtrain); and
jaxtrain's subpackages (and top-level modules) form no loop either. The last known cycles were cut
by moving what both sides need below both (data/text_files.py, train_state.py,
training/restore_latest.py) and by handing the Trainer its sampler instead of importing generation."""
import pytest

from import_graph import PACKAGES, cycles, edges_within, layer_of, module_graph, package_graph, package_of, stale_imports

pytestmark = [pytest.mark.fast]


@pytest.fixture(scope="module")
def graph():
    return module_graph()


def test_no_module_imports_itself_round_a_loop(graph):
    found = {tuple(c): edges_within(graph, c) for c in cycles(graph)}
    assert not found, "import cycles between modules:\n" + "\n".join(f"{c}: {e}" for c, e in found.items())


def test_each_layer_imports_only_the_layers_below_it(graph):
    rank = {package: i for i, package in enumerate(PACKAGES)}
    upward = sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs if rank[layer_of(b)] > rank[layer_of(a)])
    assert not upward, f"imports of a higher layer ({' < '.join(PACKAGES)}): {upward}"


def test_packages_form_no_loop(graph):
    loops = cycles(package_graph(graph))
    assert not loops, "import loops between packages (each with the module imports behind it):\n" + "\n".join(
        f"{c}: {edges_within(graph, c, package_of)}" for c in loops)


def test_the_layers_are_imported_under_jaxtrain_only():
    """`jaxtrain.models`, never `models`: a second name would load a second copy of each module."""
    assert not stale_imports(), stale_imports()
