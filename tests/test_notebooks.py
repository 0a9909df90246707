"""Every notebook in notebooks/ executes top to bottom without a cell error.

The notebooks generate small random checkpoints with the real GPT-NeoX tokenizer
and read the published benchmark file, both from ../shared/data/ (skipped when
that is missing). They run in a fresh Jupyter kernel on *this* interpreter: the
test writes a throw-away "python3" kernelspec pointing at sys.executable into a
temporary directory and puts it first on JUPYTER_PATH, so nothing is registered
globally and a stale user/system kernelspec (another Python) is never used.
"""
import glob
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NOTEBOOKS = os.path.join(ROOT, "notebooks")
SHARED_DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")
NEEDED = ("gpt-neox-20b-tokenizer.json", "synthetic_dataset.jsonl")
# environment variables the notebooks read: unset so the test runs the generated models
NOTEBOOK_ENV = ("DCSCOPE_MODEL", "DCSCOPE_PYTHIA", "DCSCOPE_DEVICE", "DCSCOPE_TOKENIZER", "DCSCOPE_DATA")

PATHS = sorted(glob.glob(os.path.join(NOTEBOOKS, "*.ipynb")))


def test_there_are_notebooks():
    assert PATHS, "no notebooks found in %s" % NOTEBOOKS


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    """A private 'python3' kernelspec for the running interpreter, first on JUPYTER_PATH."""
    pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install -e .[test])")
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (dcscope tests)",
        "language": "python",
    }))
    old = os.environ.get("JUPYTER_PATH")
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join([str(tmp_path / "jupyter")] + ([old] if old else [])))
    for name in NOTEBOOK_ENV:
        monkeypatch.delenv(name, raising=False)
    return str(spec_dir)


@pytest.mark.parametrize("path", PATHS, ids=[os.path.basename(p) for p in PATHS])
def test_notebook_executes(path, kernel_env):
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e .[test])")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -e .[test])")
    missing = [n for n in NEEDED if not os.path.exists(os.path.join(SHARED_DATA, n))]
    if missing:
        pytest.skip("shared data not found: %s (expected in %s)" % (", ".join(missing), SHARED_DATA))

    from jupyter_client.kernelspec import KernelSpecManager
    spec = KernelSpecManager().get_kernel_spec("python3")
    assert os.path.realpath(spec.resource_dir) == os.path.realpath(kernel_env), \
        "the private kernelspec is not the one found: %s" % spec.resource_dir
    assert spec.argv[0] == sys.executable

    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        "%s is saved with outputs: clear them before committing" % os.path.basename(path)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": NOTEBOOKS}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail("%s: a cell failed:\n%s" % (os.path.basename(path), e), pytrace=False)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, "%s: %d cell(s) produced errors" % (os.path.basename(path), len(errors))
