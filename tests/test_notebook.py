"""examples/quickstart.ipynb runs top to bottom on a CPU, as a user would run it."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import FAST_COMPILE

NOTEBOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "quickstart.ipynb")


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    # One CPU device, as on a user's machine (the suite's 8 fake devices would shard the batch 8 ways).
    monkeypatch.setenv("XLA_FLAGS", FAST_COMPILE)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, errors
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")  # stdout and stderr
    assert "velocity (2, 4, 32, 32, 3)" in text and "DSV stage 2" in text
    assert "frames (2, 4, 32, 32, 3) uint8" in text  # dsv_jax.generate
    assert "IProgress" not in text and "TqdmWarning" not in text, text  # no notebook bar without ipywidgets
    images = [o for o in outputs if o.output_type == "display_data"]
    assert sum("image/gif" in o.data for o in images) == 1  # the sampled clip, inline
    assert sum("image/png" in o.data for o in images) == 2  # loss curve and the sparsity of block 0
