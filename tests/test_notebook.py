"""The quick-start notebook: committed valid and with the outputs of a real run (the learner learns, visibly), and
executed top to bottom, shortened (slow, run in CI)."""

import json
import re
import sys
import time
from pathlib import Path

import pytest


NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "notebooks" / "mempo_quickstart.ipynb"
CELL_TIMEOUT_S = 900


def test_committed_notebook_is_valid_and_shows_a_real_run():
    nbformat = pytest.importorskip("nbformat")

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code_cells
    counts = [cell.execution_count for cell in code_cells]
    assert counts == list(range(1, len(code_cells) + 1)), "run top to bottom once before committing"
    assert not [o for c in code_cells for o in c.outputs if o.get("output_type") == "error"]
    assert "2603.00680" in nb.cells[0].source  # the intro links the paper
    text = _outputs_text(nb)
    # The full run: 40 steps, 100 held-out questions, and the run time said.
    assert re.search(r"notebook wall time: \d+ s \(40 MemPO steps, 100 held-out questions\)", text)
    before, after = map(
        float, re.search(r"held-out EM \(100 questions, greedy\): ([\d.]+) before training -> ([\d.]+)", text).groups()
    )
    assert after > before  # the learner learned
    images = [o for c in code_cells for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 2  # the training curves and the context-tokens plot, visible without running it


def _kernel_path(tmp_path: Path) -> Path:
    """A `python3` kernelspec running this interpreter, first on JUPYTER_PATH.

    So the kernel is the current venv's ipykernel, whatever a user-level kernelspec (or none) says.
    """
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return tmp_path / "jupyter"


def _outputs_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            parts.append(str(output.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_notebook_executes(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")

    out = tmp_path / "outputs"
    out.mkdir()
    monkeypatch.setenv("MEMPO_NOTEBOOK_STEPS", "2")
    monkeypatch.setenv("MEMPO_NOTEBOOK_HELDOUT", "20")
    monkeypatch.setenv("JUPYTER_PATH", str(_kernel_path(tmp_path)))
    monkeypatch.setenv("MEMPO_NOTEBOOK_OUT", str(out))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    monkeypatch.delenv("MEMPO_PUSH", raising=False)

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(tmp_path)}}
    )
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first failing cell
    print(f"notebook executed in {time.perf_counter() - start:.0f} s")

    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    model_dir = out / "mempo-learner"
    assert (model_dir / "config.json").is_file()
    assert (model_dir / "model.safetensors").is_file()
    card = (model_dir / "README.md").read_text(encoding="utf-8")
    assert "## Training procedure" in card and "2603.00680" in card and "pip install" in card
    assert (out / "learner_world" / "corpus.jsonl").is_file()
    for plot in ("training_curves.png", "context_tokens.png"):
        assert (out / plot).stat().st_size > 1000, plot
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 2  # the training curves and the context-tokens plot are shown inline
    text = _outputs_text(nb)
    assert "held-out EM (20 questions, greedy)" in text
    assert "Dry run" in text  # the push cell did not push
    assert "total_token_reduction_pct" in text
    assert "notebook wall time" in text
