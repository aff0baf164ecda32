"""Runs examples/notebook.ipynb in a real Jupyter kernel and checks its outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient", reason="nbclient and ipykernel run the notebook")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).parents[2] / "examples" / "notebook.ipynb"


@pytest.mark.slow
def test_notebook_runs_in_a_kernel() -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=90, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()
    text = "\n".join(
        "".join(output.get("text", "")) for cell in notebook.cells if cell.cell_type == "code"
        for output in cell.outputs
    )
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    assert "WorkerInfo(id=0, name=worker0) 2" in text
    assert "gradients match: True" in text
    assert "rpc_sync: [2.0, 2.0]" in text
    assert "proxy sum: 4.0" in text
    assert "shut down" in text
