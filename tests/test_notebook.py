"""The quickstart notebook executes top to bottom (build, train, restore, sample, plot) opened from
its own folder, as Jupyter opens it, shows its plots inline and leaves no run directory behind.
From the repository root its set-up cell, the only one that depends on the folder (it finds
gin_configs/), runs as well."""

import glob
import os
import tempfile

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "experiments", "notebooks", "quickstart.ipynb")


def execute(nb, cwd: str) -> list[dict]:
  """Runs the notebook's cells in a fresh kernel started in `cwd`; returns the code cells'
  outputs."""
  nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": cwd}}).execute()
  return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


@pytest.mark.slow
def test_quickstart_notebook_runs_from_its_own_folder(tmp_path, monkeypatch):
  # The notebook's temporary run directory goes under tmp_path, where the test can see what is
  # left (the kernel inherits TMPDIR).
  monkeypatch.setenv("TMPDIR", str(tmp_path))
  nb = nbformat.read(NOTEBOOK, as_version=4)
  outputs = execute(nb, os.path.dirname(NOTEBOOK))
  text = "".join(o.get("text", "") for o in outputs)
  assert "finished: True at step 6" in text
  assert "loss.png" in text
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(images) >= 2, [sorted(o.get("data", {})) for o in outputs]   # the plots, inline
  assert not glob.glob(os.path.join(str(tmp_path), "k3jax_quickstart_*"))


def test_quickstart_set_up_cell_runs_from_the_root():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  first_code = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
  nb.cells = nb.cells[:first_code + 1]
  text = "".join(o.get("text", "") for o in execute(nb, REPO))
  assert "parameters" in text and "'kda'" in text, text
