"""README's "The core in one minute" runs as written: a reader copies it into a file first. It
used names it never defined (embedding, sublayers, encoder, src, layer, idx, targets)."""
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_core_in_one_minute_runs_as_written(tmp_path):
    text = (ROOT / "README.md").read_text()
    section = text.split("## The core in one minute", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "core.py"
    script.write_text(code)
    names = runpy.run_path(str(script))
    assert names["out"].shape == names["embedding"].shape
    assert names["logits"].shape == (2, 64, 256) and names["loss"].ndim == 0
