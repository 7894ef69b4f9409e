"""The stock `lm_eval` command finds the model `attnres` after a plain install.

The .pth start-up hook (attnres_lm_eval_hook.py) is installed by the project's build backend
(build_support/attnres_build_backend.py). These tests use the install this environment already
has (README: `pip install -e ".[dev]"`, as CI does), a regular wheel built here and installed
into a throwaway virtual environment, and a .pth file left behind without its module.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch

import attnres
from attnres import DecoderLM, ModelConfig, ResidualConfig

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install 'lm-eval==0.4.13')")

from test_eval_cli import write_tasks  # the offline task fixtures: JSONL + YAML

ROOT = Path(__file__).resolve().parents[1]
PTH = "attnres_lm_eval_hook.pth"
UNKNOWN_MODEL = "no model for this name found"  # lm-eval 0.4.13's get_model error


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny checkpoint written by attnres.save_pretrained, and the offline tasks."""
    tmp = tmp_path_factory.mktemp("plugin")
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(d_model=32, layers=2, n_heads=2, max_seq_len=64), ResidualConfig(name="block", block_size=2))
    attnres.save_pretrained(model, tmp / "ck")
    (tmp / "tasks").mkdir()
    write_tasks(tmp / "tasks")
    return tmp


def outside_env(tmp: Path) -> dict:
    """Offline, and nothing from the checkout on the path: the project must come from its install."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp / "hf"),
           "ATTNRES_CACHE": "off", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    return env


def python(code: str, cwd: Path, env: dict, interpreter: str = sys.executable, flags: tuple = ()) -> subprocess.CompletedProcess:
    return subprocess.run([interpreter, *flags, "-c", code], cwd=cwd, env=env, check=False, capture_output=True, text=True, timeout=120)


def installed_pth() -> list[Path]:
    folders = [*site.getsitepackages(), site.getusersitepackages()]
    return [Path(f) / PTH for f in folders if (Path(f) / PTH).is_file()]


def test_the_stock_lm_eval_command_runs_attnres(files, tmp_path):
    assert installed_pth(), f"{PTH} is not in site-packages: install the project as the README says (pip install -e '.[dev]')"
    lm_eval = Path(sysconfig.get_path("scripts")) / "lm_eval"
    assert lm_eval.is_file(), f"lm-eval's console script is missing: {lm_eval}"
    out = subprocess.run(
        [str(lm_eval), "--model", "attnres", "--model_args", f"pretrained={files / 'ck'}", "--tasks", "tiny_mc",
         "--include_path", str(files / "tasks"), "--limit", "2", "--device", "cpu", "--output_path", str(tmp_path / "out")],
        cwd=tmp_path, env=outside_env(tmp_path), check=False, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "attnres (" in out.stdout and "|tiny_mc" in out.stdout and "acc" in out.stdout, out.stdout
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(results_file.read_text())
    assert results["config"]["model"] == "attnres"
    assert 0.0 <= results["results"]["tiny_mc"]["acc,none"] <= 1.0
    assert results["n-samples"]["tiny_mc"]["effective"] == 2


def test_start_up_loads_only_the_hook(tmp_path):
    """Every Python start runs the .pth: it must import neither torch, lm-eval nor the project."""
    out = python("import sys; print(sorted(m for m in ('torch', 'lm_eval', 'evaluation', 'attnres', 'attnres_lm_eval_hook') "
                 "if m in sys.modules)); print([type(f).__name__ for f in sys.meta_path].count('_RegisterAfterLmEvalModels'))",
                 tmp_path, outside_env(tmp_path))
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.splitlines() == ["['attnres_lm_eval_hook']", "1"]


def test_registration_is_lazy_and_keeps_lm_evals_models(tmp_path):
    out = python(
        "import sys\n"
        "from lm_eval.api.registry import get_model, model_registry\n"
        "import lm_eval.models\n"
        "print(model_registry._objs['attnres'], 'torch' in sys.modules, 'evaluation.lm_eval_adapter' in sys.modules)\n"
        "print(get_model('attnres').__module__, 'hf' in model_registry, type(lm_eval.models.__loader__).__name__)\n",
        tmp_path, outside_env(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    placeholder, resolved = out.stdout.splitlines()
    # Registered as lm-eval registers its own models: a "module:object" string, nothing imported yet.
    assert placeholder == "evaluation.lm_eval_adapter:AttnResLM False False"
    # The loader wrapper hands lm_eval.models its real loader back.
    assert resolved == "evaluation.lm_eval_adapter True SourceFileLoader"


def test_importing_the_adapter_first_keeps_lm_evals_models(tmp_path):
    """`python -m evaluation.lm_eval_cli` and `import evaluation.lm_eval_adapter` register `attnres`
    before any lookup: lm-eval's own models must still be there."""
    out = python("import evaluation.lm_eval_adapter as a\nfrom lm_eval.api.registry import get_model\n"
                 "print(get_model('attnres') is a.AttnResLM, get_model('dummy').__name__)", tmp_path, outside_env(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "DummyLM"]


def test_without_the_package_lm_eval_gives_its_usual_error(tmp_path):
    """The hook is installed, but the adapter's package cannot be imported: lm-eval says the name is
    unknown, as it would without this project, instead of failing to import."""
    out = python(
        "import sys\n"
        "assert 'attnres_lm_eval_hook' in sys.modules\n"
        "sys.modules['evaluation'] = None  # 'import evaluation' now raises ModuleNotFoundError\n"
        "from lm_eval.api.registry import get_model\n"
        "get_model('attnres')\n",
        tmp_path, outside_env(tmp_path))
    assert out.returncode == 1
    assert f"ValueError: Attempted to load model 'attnres', but {UNKNOWN_MODEL}" in out.stderr, out.stderr[-3000:]
    assert "Error processing line" not in out.stderr  # site did not trip over the .pth


def test_a_pth_without_its_module_is_silent(tmp_path):
    """An editable install whose checkout is gone leaves the .pth behind: no error at every start."""
    assert installed_pth(), f"{PTH} is not in site-packages: install the project as the README says"
    folder = tmp_path / "site"
    folder.mkdir()
    shutil.copy(installed_pth()[0], folder)
    out = python(f"import site, sys; site.addsitedir({str(folder)!r}); print('attnres_lm_eval_hook' in sys.modules)",
                 tmp_path, outside_env(tmp_path), flags=("-S", "-I"))
    assert (out.returncode, out.stdout.strip(), out.stderr) == (0, "False", "")


SOURCES = ["pyproject.toml", "README.md", "MANIFEST.in", "attnres_lm_eval_hook.py", "build_support",
           "attnres", "harness", "analysis", "evaluation", "hydra_plugins"]


def record_rows(wheel: zipfile.ZipFile) -> dict[str, str]:
    (record,) = [n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")]
    return {row.split(",")[0]: row for row in wheel.read(record).decode().splitlines() if row}


def test_wheels_carry_the_pth_and_a_regular_install_works(tmp_path):
    pytest.importorskip("setuptools", reason="the build backend wraps setuptools (pip's build isolation installs it)")
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:  # a copy, so that building leaves no build/ or egg-info in the checkout
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    wheels, lines = [], set()
    for hook in ("build_wheel", "build_editable"):  # one process per hook, as pip runs them; setuptools stays out of this one
        build = ("import json, sys; sys.path.insert(0, 'build_support'); import attnres_build_backend as b; "
                 f"print('WHEEL=' + b.{hook}(sys.argv[1])); print('LINE=' + json.dumps(b.PTH_LINE))")
        out = subprocess.run([sys.executable, "-c", build, str(tmp_path / "dist")], cwd=src, check=False, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        # setuptools logs to stdout too
        wheels += [tmp_path / "dist" / line[6:] for line in out.stdout.splitlines() if line.startswith("WHEEL=")]
        lines |= {json.loads(line[5:]) for line in out.stdout.splitlines() if line.startswith("LINE=")}
    regular, editable = wheels
    (line,) = lines
    for wheel_path in (regular, editable):
        with zipfile.ZipFile(wheel_path) as wheel:
            assert wheel.read(PTH).decode() == line
            digest = base64.urlsafe_b64encode(hashlib.sha256(line.encode()).digest()).rstrip(b"=").decode()
            assert record_rows(wheel)[PTH] == f"{PTH},sha256={digest},{len(line.encode())}"
            (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
            assert "[lm_eval.models]\nattnres = evaluation.lm_eval_adapter:AttnResLM" in wheel.read(entry_points).decode()
    with zipfile.ZipFile(editable) as wheel:
        (own_pth,) = [n for n in wheel.namelist() if n.startswith("__editable__") and n.endswith(".pth")]
        assert own_pth < PTH  # site reads .pth files in sorted order: setuptools' finder is in place first
    with zipfile.ZipFile(regular) as wheel:
        assert "attnres_lm_eval_hook.py" in wheel.namelist() and "evaluation/lm_eval_adapter.py" in wheel.namelist()

    # A regular (non-editable) install, in a virtual environment that sees this one's lm-eval and
    # torch. Its own site-packages come first on the path, so the hook and adapter come from it.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True, timeout=120)
    vpython = venv / "bin" / "python"
    pip = subprocess.run([sys.executable, "-m", "pip", "--python", str(vpython), "install", "--no-deps", "--no-index", "-q", str(regular)],
                         check=False, capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-3000:]
    out = python("import attnres_lm_eval_hook as h; from lm_eval.api.registry import get_model; "
                 "import inspect; print(h.__file__); print(inspect.getfile(get_model('attnres')))",
                 tmp_path, outside_env(tmp_path), str(vpython))
    assert out.returncode == 0, out.stderr[-3000:]
    purelib = subprocess.run([str(vpython), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert out.stdout.split() == [f"{purelib}/attnres_lm_eval_hook.py", f"{purelib}/evaluation/lm_eval_adapter.py"]
