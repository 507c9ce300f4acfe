"""examples/quickstart.ipynb executes top to bottom on CPU (nbclient, a fresh Python kernel), so it cannot rot.

The kernel gets this test run's XLA flags with one device and a temporary workdir (``QUICKSTART_WORKDIR``); the
checks read what the notebook printed: its shortened run finished with an evaluation, the bad override was refused
naming the field, and the token view found tokens outside the region.
"""
import os
from pathlib import Path

import pytest

from conftest import xla_flags

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "quickstart.ipynb"


def _text(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            out.append(o["text"])
        elif "data" in o and "text/plain" in o["data"]:
            out.append(o["data"]["text/plain"])
    return "".join(out)


def test_the_notebook_is_stored_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")


TEST_SIZE = ("model.num_hidden_layers=1,model.hidden_size=64,model.intermediate_size=128,sft.steps=40,"
             "sft.batch_size=32,sft.warmup_steps=5,steps=4,rl.prompts_per_step=8,eval.num_prompts=16,"
             "eval.every_steps=2,checkpoint.every_steps=4")


@pytest.mark.slow
def test_the_quickstart_notebook_executes(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("XLA_FLAGS", xla_flags())  # one CPU device, this test run's compile-speed flags
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # CI installs libtpu (the tpu extra): no TPU to look for
    monkeypatch.setenv("QUICKSTART_WORKDIR", str(tmp_path / "quickstart"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(NOTEBOOK.parents[1])] + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The notebook as a user runs it, on a smaller model and fewer steps (the test checks the cells run and what
    # they print, not what the run learns): the one cell that sets SHORT gets these overrides appended.
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and "SHORT = (" in c.source]
    cell.source = cell.source.replace('log.progress=False")', 'log.progress=False," + TEST_SIZE)')
    assert "+ TEST_SIZE)" in cell.source
    cell.source = f"TEST_SIZE = {TEST_SIZE!r}\n" + cell.source
    nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "refused: trust_region" in text and "delta must be a finite float > 0, got -1.0" in text
    assert "final_accuracy" in text and (tmp_path / "quickstart" / "curves.png").exists()
    assert any(o.get("data", {}).get("image/png") for c in nb.cells for o in c.get("outputs", []))
    assert "token updates outside δ = 0.005" in text and "PDM dropped" in text
