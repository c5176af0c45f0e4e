"""notebooks/quickstart.ipynb runs clean, headless, in a real Jupyter kernel of this venv."""
from __future__ import annotations

import pytest
import os
import sys

import nbclient
import nbformat

pytestmark = [pytest.mark.slow, pytest.mark.end_to_end, pytest.mark.extended]

NOTEBOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks", "quickstart.ipynb")


def test_quickstart_notebook_runs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # jupyter_client starts the `python3` kernel with this interpreter (sys.executable); the
    # notebook's first cell prints its prefix so the check below proves it.
    client = nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    first = "".join(o.get("text", "") for o in notebook.cells[1].outputs)
    assert f"prefix: {sys.prefix}" in first
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    text = "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.outputs)
    assert "parameters identical: True" in text and "identical after HF round trip: True" in text
