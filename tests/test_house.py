"""The house rules a reader relies on: the core stands alone, the variant list has one source
(attnres.VARIANTS) that every sweep listing all variants and the analysis agree with, and no
function outside the kernels runs past 80 lines."""
import ast
from pathlib import Path

import pytest
import yaml

from attnres import VARIANTS

ROOT = Path(__file__).resolve().parents[1]


def test_no_file_of_the_core_imports_the_harness_or_the_tools_around_it():
    outside = {"harness", "analysis", "evaluation", "hydra_plugins", "hydra", "omegaconf"}
    found = []
    for path in sorted((ROOT / "attnres").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in outside]
    assert found == []


def _sweep_residuals(name: str) -> list[str]:
    params = yaml.safe_load((ROOT / "sweeps" / f"{name}.yaml").read_text())["hydra"]["sweeper"]["params"]
    return [v.strip() for v in str(params["residual"]).split(",")]


@pytest.mark.parametrize("sweep", ["ablation", "lr", "tuned_lr"])  # ablation_gpu inherits ablation's list
def test_every_sweep_of_all_variants_lists_exactly_attnres_variants(sweep):
    assert _sweep_residuals(sweep) == list(VARIANTS)


def test_the_analysis_knows_exactly_the_variants_of_the_core():
    from analysis.paper import KNOWN_VARIANTS

    assert sorted(KNOWN_VARIANTS) == sorted(VARIANTS)


def _project_files() -> list[Path]:
    """Every .py file of the project but the tests and the kernels (and hidden folders: .git, a venv)."""
    files = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "tests" or rel.parts[:2] == ("attnres", "kernels") or \
                any(p.startswith(".") for p in rel.parts[:-1]):
            continue
        files.append(rel)
    return files


def test_no_function_of_the_project_outside_the_kernels_runs_past_80_lines():
    files = _project_files()
    # the walk reaches the scripts and the core, not only one folder
    assert {Path("run.py"), Path("benchmarks/model_bench.py"), Path("attnres/model.py")} <= set(files)
    long = []
    for rel in files:
        for fn in ast.walk(ast.parse((ROOT / rel).read_text(), filename=str(rel))):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.end_lineno - fn.lineno + 1 > 80:
                long.append(f"{rel}:{fn.lineno} {fn.name} ({fn.end_lineno - fn.lineno + 1} lines)")
    assert long == [], "functions over 80 lines: " + ", ".join(long)
