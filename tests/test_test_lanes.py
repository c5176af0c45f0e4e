"""Each test module declares its own lane (issue 25.6): tests/conftest.py turns a module without
exactly one of fast / slow in its `pytestmark` into a collection error that names the module and
the markers to choose from."""
import types

import pytest

import conftest

pytestmark = [pytest.mark.fast]


def module(marks) -> types.ModuleType:
    m = types.ModuleType("test_made_up")
    m.__file__ = "tests/test_made_up.py"
    if marks is not None:
        m.pytestmark = marks
    return m


@pytest.mark.parametrize("marks", [[pytest.mark.fast], [pytest.mark.slow, pytest.mark.end_to_end],
                                   pytest.mark.slow, [pytest.mark.usefixtures("tmp_path"), pytest.mark.fast]])
def test_a_module_with_one_lane_is_collected(marks):
    assert conftest.lane_problem(module(marks)) is None


@pytest.mark.parametrize("marks, said", [(None, "declares no lane"),
                                         ([pytest.mark.end_to_end], "declares no lane"),
                                         (pytest.mark.usefixtures("tmp_path"), "declares no lane"),
                                         ([pytest.mark.fast, pytest.mark.slow], "declares fast and slow")])
def test_a_module_without_exactly_one_lane_is_refused_with_the_choices(marks, said):
    problem = conftest.lane_problem(module(marks))
    assert problem is not None and problem.startswith(f"tests/test_made_up.py: {said}")
    assert "pytestmark = [pytest.mark.fast]" in problem
    for name in (*conftest.LANES, *conftest.MARKERS):
        assert f"  {name} " in problem


def test_every_marker_a_module_may_declare_is_registered(pytestconfig):
    """--strict-markers or not, a lane marker pytest does not know is a typo waiting to happen."""
    registered = {line.split(":")[0] for line in pytestconfig.getini("markers")}
    assert set(conftest.LANES) | set(conftest.MARKERS) <= registered
