"""Hostile and damaged input to the analysis: run-given text escaped for Markdown, HTML and LaTeX;
snapshots with one variant, duplicate rows, unusable losses or damaged side files; the adaptive
stage asked for another recipe or given bad arguments; the CLI's bad arguments."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis import markup
from analysis.__main__ import main as analysis_main

REPO = Path(__file__).resolve().parents[1]
XSS = "<img src=x onerror=alert(1)>"


def _rows(variants=("baseline", "block", "full"), seeds=(0, 1, 2), sweep="ablation", **extra):
    """FINISHED ablation rows of one recipe, block and full a little below the baseline."""
    off = {"baseline": 0.0, "block": -0.02, "full": -0.03}
    noise = np.random.default_rng(len(variants)).normal(0, 0.003, (len(variants), len(seeds)))
    return [{"run_id": f"{v}-{s}", "experiment": sweep, "sweep": sweep, "variant": v, "seed": s,
             "status": "FINISHED", "final_val_loss": 2.0 + off.get(v, 0.01) + noise[i, j],
             "model": "tiny", "tokens": 40960.0, "run_key": f"k-{v}-{s}", **extra}
            for i, v in enumerate(variants) for j, s in enumerate(seeds)]


def _snapshot(folder: Path, rows) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "runs.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def _report(snapshot: Path, out: Path) -> int:
    return analysis_main(["report", "--snapshot", str(snapshot), "--out", str(out), "--n-boot", "10"])


# --------------------------------------------------------------------------------------------
# Escaping
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hostile", [XSS, "<script>x</script>", "[click](javascript:alert(1))",
                                     "**bold** `code` $x$ ~~s~~ _em_ a|b"])
def test_markdown_escape_leaves_no_active_markup(hostile):
    out = markup.md(hostile)
    assert "<" not in out and ">" not in out
    assert "](" not in out.replace("\\](", "")  # no link survives
    for ch in "*`$~|":  # each active character is escaped
        assert out.count(ch) == out.count("\\" + ch)
    assert not re.search(r"(?<![\\A-Za-z0-9])_", out)


def test_markdown_escape_keeps_ordinary_names_and_intervals_as_written():
    for name in ("study_cpu", "no_key_norm", "baseline", "[0.715, 1.419]", "0.03", "−0.1 ± 0.2"):
        assert markup.md(name) == name
    assert markup.md_cell("a|b\nc") == "a\\|b c"


def test_html_and_latex_escape():
    assert markup.html(XSS) == "&lt;img src=x onerror=alert(1)&gt;"
    assert markup.html('"\'&') == "&quot;&#x27;&amp;"
    tex = markup.latex("$x} {y\\ 50% a_b #1 ~^ ±")
    assert tex == (r"\$x\} \{y\textbackslash{} 50\% a\_b \#1 \textasciitilde{}\textasciicircum{} "
                   r"$\pm$")
    # every brace left is one of an escape's own (balanced), no bare $ outside the ± macro
    assert tex.count("{") == tex.count("}") and tex.replace(r"\$", "").replace(r"$\pm$", "").count("$") == 0


def test_hostile_names_are_escaped_in_the_report_and_its_tables(tmp_path):
    """A sweep name, a variant and a failure text holding HTML, and a variant with `$` and `}`,
    reach REPORT.md, the .md tables and the .tex table escaped."""
    rows = _rows(sweep=f"ablation{XSS}") + _rows(("x$y}",), sweep=f"ablation{XSS}")
    rows.append({"run_id": "dead", "experiment": "e", "sweep": f"ablation{XSS}", "variant": XSS,
                 "seed": 0, "status": "FAILED", "failure": f"ValueError: {XSS}\n| boom",
                 "final_val_loss": None})
    out = tmp_path / "out"
    assert _report(_snapshot(tmp_path / "snap", rows), out) in (0, 1)
    texts = {p.name: p.read_text() for p in [out / "REPORT.md", *(out / "tables").glob("*.md")]}
    assert "table4_ablation.md" in texts
    for name, text in texts.items():
        assert "<img" not in text and "<script" not in text, name
    assert "&lt;img src=x onerror=alert(1)&gt;" in texts["REPORT.md"]
    tex = (out / "tables" / "table4_ablation.tex").read_text()
    assert r"x\$y\}" in tex and "x$y}" not in tex
