"""The benchmark commands run end to end at toy sizes (they are not timed here: RESULTS.md holds
the figures) and reject bad arguments with argparse's one error line, exit status 2."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import decode_bench  # noqa: E402
import model_bench  # noqa: E402
import op_bench  # noqa: E402


def test_model_bench_writes_ratios_to_the_baseline(tmp_path, capsys, monkeypatch):
    built = {}

    def recording(cfg, residual):  # which residual each model is built with
        built[residual.name] = residual
        return model_bench_model(cfg, residual)

    model_bench_model = model_bench.DecoderLM
    monkeypatch.setattr(model_bench, "DecoderLM", recording)
    out = tmp_path / "mb.json"
    info = model_bench.main(["--variants", "block,mhc", "--layers", "3", "--blocks", "2", "--batch", "2",
                             "--seq-len", "16", "--rounds", "2", "--warmup", "1", "--threads", "1", "--json", str(out)])
    # --blocks 2 at 6 sublayers: S = 3 for Block, in the model and in the record
    assert built["block"].block_size == 3 and info["block_size"] == 3
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["baseline", "block", "mhc"] and rows == {r["variant"]: r for r in info["rows"]}
    assert rows["baseline"]["ratio"] == 1.0 and rows["baseline"]["memory_ratio"] == 1.0
    assert all(r["step_ms"] > 0 and r["peak_mib"] > 0 for r in rows.values())
    assert "block" in capsys.readouterr().out


def test_model_bench_stopped_mid_run_reports_the_rounds_it_finished(tmp_path, monkeypatch):
    """A stop during the rounds (Ctrl-C; SIGTERM from run_gpu.sh's time limit, which the bench
    turns into the same interrupt) still writes the table for the rounds done, without the
    memory pass; SIGTERM's handler is the caller's again afterwards."""
    import signal

    import torch

    steps = 0
    step = torch.optim.AdamW.step

    def counted(self, *args, **kwargs):  # warmup: 2 steps, then 2 per round; stop in round 3
        nonlocal steps
        steps += 1
        if steps == 7:
            raise KeyboardInterrupt
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", counted)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "mb.json"
    info = model_bench.main(["--variants", "block", "--layers", "2", "--batch", "2", "--seq-len", "16",
                             "--rounds", "5", "--warmup", "1", "--threads", "1", "--json", str(out)])
    assert json.loads(out.read_text())["rounds"] == info["rounds"] == 2
    assert [r["variant"] for r in info["rows"]] == ["baseline", "block"]
    assert all(r["step_ms"] > 0 and "peak_mib" not in r for r in info["rows"])
    assert signal.getsignal(signal.SIGTERM) is before


def test_model_bench_sets_triton_knobs_and_records_them(tmp_path, monkeypatch, capsys):
    """--triton NAME=VALUE sets a knob of the Triton kernels for the run (what run_gpu.sh times
    beside the defaults) and the JSON records it; a name that is not a knob, or a value that is
    neither an integer nor true/false/none, is one line and exit 2."""
    pytest.importorskip("triton")
    from attnres.kernels import triton_kernels as tk

    for name in tk.KNOBS:  # restored after the test
        monkeypatch.setattr(tk, name, getattr(tk, name))
    out = tmp_path / "mb.json"
    info = model_bench.main(["--variants", "block", "--layers", "2", "--batch", "2", "--seq-len", "16", "--rounds", "2",
                             "--warmup", "1", "--threads", "1", "--no-memory", "--triton", "READER_GROUP=2",
                             "--triton", "BWD_DQ_SECOND_PASS=true", "--triton", "PREFETCH=false", "--json", str(out)])
    want = {"READER_GROUP": 2, "BWD_DQ_SECOND_PASS": True, "PREFETCH": False}
    assert info["triton_knobs"] == json.loads(out.read_text())["triton_knobs"] == want
    assert (tk.READER_GROUP, tk.BWD_DQ_SECOND_PASS, tk.PREFETCH) == (2, True, False)
    capsys.readouterr()
    for bad in ("READER_GROUPS=2", "READER_GROUP=two"):
        with pytest.raises(SystemExit) as stop:
            model_bench.main(["--variants", "block", "--triton", bad])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert stop.value.code == 2 and f"--triton {bad!r}: allowed: NAME=VALUE with NAME one of READER_GROUP" in err


def test_model_bench_stopped_in_its_warm_up_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """Stopped while compiling (the warm-up), there is nothing to report: one line naming the
    variant, exit 130, no JSON."""
    import signal

    import torch

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.optim.AdamW, "step", interrupted)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stop:
        model_bench.main(["--variants", "block", "--layers", "2", "--batch", "2", "--seq-len", "16",
                          "--threads", "1", "--json", str(tmp_path / "mb.json")])
    assert stop.value.code == 130 and not (tmp_path / "mb.json").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("model_bench: interrupted in the warm-up of baseline after "), err
    assert signal.getsignal(signal.SIGTERM) is before


def test_run_gpu_without_a_gpu_says_so_in_one_line(tmp_path):
    import subprocess

    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "run_gpu.sh")], capture_output=True, text=True,
                       env={**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable},
                       timeout=120)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.startswith("run_gpu.sh: no CUDA device") and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "out").exists()


def test_run_gpu_refuses_an_unknown_argument_in_one_line(tmp_path):
    import subprocess

    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "run_gpu.sh"), "--dryrun"], capture_output=True, text=True,
                       env={**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}, timeout=60)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1 and "--dry-run" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # every stage at a tiny size, the device check under Triton's interpreter (minutes)
def test_run_gpu_dry_run_runs_every_stage_and_prints_every_bar(tmp_path):
    """run_gpu.sh --dry-run: the whole script on CPU at a tiny size. Every stage exits 0, the
    output folder holds gpu.txt, gpu_check.rc and the three benchmarks' JSON (at most the eight
    files a lent machine returns), and the bars are printed, one line each: the device check met
    (the smoke checks pass), fla-core not measured (no fla-core on CPU), every other bar with a figure."""
    import subprocess

    out = tmp_path / "out"
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "run_gpu.sh"), "--dry-run"], capture_output=True, text=True,
                       env={**os.environ, "OUT": str(out), "PYTHON": sys.executable}, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["decode_bench.json", "gpu.txt", "gpu_check.rc", "model_bench.json",
                                                     "op_bench.json"]
    for stage in ("gpu_check", "op_bench", "model_bench", "decode_bench"):
        assert f"== {stage}: exit 0" in r.stdout, r.stdout[-3000:]
    bars = [line for line in r.stdout.splitlines() if line.startswith("BAR ")]
    assert len(bars) == 6, bars
    assert bars[0].startswith("BAR device check: met") and "fla-core not measured" in bars[1]
    assert all("×" in line and "not measured" not in line for line in bars[2:]), bars
    assert (out / "gpu.txt").read_text().count("BAR ") == 6


def test_bars_read_each_benchmark_and_say_where_a_figure_is_missing(tmp_path, capsys):
    """bars.py's verdicts from hand-made outputs: a figure at or under its bar is met, above it
    not, a stage that wrote nothing is not measured; fla-core's time decides the op-level bar."""
    import bars

    machine = dict(cpu="cpu", cpu_count=1, torch="t", python="p", gpu="NVIDIA H200")
    (tmp_path / "gpu_check.rc").write_text("0\n")
    (tmp_path / "op_bench.json").write_text(json.dumps(dict(
        machine=machine, sublayers=32, block_size=4, tokens=16384, d=2048, dtype="bfloat16",
        rows=[dict(impl="fused per read", ms=29.0), dict(impl="fused two-phase", ms=35.0),
              dict(impl="fla fused_attnres", ms=29.9)])))
    rows = [dict(variant="baseline", ratio=1.0, ratio_q1=1.0, ratio_q3=1.0, step_ms=100.0, peak_mib=1000.0),
            dict(variant="block", ratio=1.04, ratio_q1=1.03, ratio_q3=1.05, step_ms=104.0, peak_mib=1150.0,
                 memory_ratio=1.15),
            dict(variant="full", ratio=1.2, ratio_q1=1.1, ratio_q3=1.3, step_ms=120.0)]
    (tmp_path / "model_bench.json").write_text(json.dumps(dict(machine=machine, preset="194m", compile=True, rounds=6,
                                                               block_size=3, rows=rows)))
    got = dict(bars.main([str(tmp_path)]))
    assert "NVIDIA H200" in capsys.readouterr().out
    assert got["device check"].startswith("met")
    assert got["op level: Block read fwd+bwd ≤ fla-core fused_attnres"].split(" [")[0].endswith(": met")
    assert got["model level: block step ≤ 1.05× baseline"].split(" [")[0].endswith(": met")
    assert got["model level: full step ≤ 1.1× baseline"].split(" [")[0].endswith(": NOT met")
    assert got["model level: block peak memory ≤ 1.1× baseline"].split(" [")[0].endswith(": NOT met")
    assert got["inference: block decode latency per token ≤ 1.02× baseline"].startswith("not measured")
    (tmp_path / "gpu_check.rc").write_text("1\n")
    assert dict(bars.bars(tmp_path))["device check"].startswith("NOT met")


def test_tile_sweep_names_a_bad_configuration_before_it_looks_for_a_gpu():
    """--config NAME=VALUE,...: knobs moved together; a name that is no knob, or a value that is
    none of the allowed, is one line naming the option and exit 2, before any look for a GPU."""
    import subprocess

    import tile_sweep

    for bad in ("PREFETCH=maybe", "PREFETCH=true,FETCH=true"):
        r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tile_sweep.py"), "--config", bad],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and f"--config {bad.split(',')[-1]!r}: allowed: NAME=VALUE" in r.stderr, r.stderr
    assert tile_sweep.parse_triton_knobs(["PREFETCH=true", "READER_GROUP=8"], None) == {
        "PREFETCH": True, "READER_GROUP": 8}


def test_tile_sweep_moves_one_knob_at_a_time_or_the_configurations_given(tmp_path, monkeypatch, capsys):
    """tile_sweep's configurations: the defaults, then each knob moved alone (a value equal to the
    default is not timed twice), or with --config the knobs moved together; --triton sets a knob in
    every row. Timing and profiling stood in (no GPU here): what runs is the choice of configurations,
    the knobs each is timed under, the table and the JSON."""
    import tile_sweep
    from attnres.kernels import triton_kernels as tk

    for name in tk.KNOBS:  # restored after the test
        monkeypatch.setattr(tk, name, getattr(tk, name))
    seen = []
    monkeypatch.setattr(tile_sweep.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tile_sweep, "make_inputs", lambda *a, **k: None)
    monkeypatch.setattr(tile_sweep, "ours", lambda *a: (lambda *x: None))
    monkeypatch.setattr(tile_sweep, "machine", lambda: {})
    monkeypatch.setattr(tile_sweep, "bench", lambda *a: [seen.append({k: getattr(tk, k) for k in tk.KNOBS}) or 1.0])
    monkeypatch.setattr(tile_sweep, "profiled", lambda *a, **k: dict(
        wall_ms=1.0, busy_ms=1.0, read_fwd_ms=float(tk.READER_GROUP or 0), read_bwd_ms=1.0, top=[]))
    default = {k: getattr(tk, k) for k in tk.KNOBS}
    info = tile_sweep.main(["--reader-groups", f"{default['READER_GROUP']},1,3", "--json", str(tmp_path / "a.json")])
    assert [r["moved"] for r in info["rows"]] == [{}, {"PREFETCH": not default["PREFETCH"]},
                                                  {"BWD_DQ_SECOND_PASS": not default["BWD_DQ_SECOND_PASS"]},
                                                  {"READER_GROUP": 1}, {"READER_GROUP": 3}]
    assert [r["read_fwd_ms"]["fused per read"] for r in info["rows"]][-1] == 3.0  # timed under its knobs
    assert seen[-1] == {**default, "READER_GROUP": 3} and {k: getattr(tk, k) for k in tk.KNOBS} == default
    info = tile_sweep.main(["--triton", "BWD_DQ_SECOND_PASS=false", "--config", "PREFETCH=false,READER_GROUP=none",
                            "--json", str(tmp_path / "b.json")])
    assert [r["moved"] for r in info["rows"]] == [{}, {"PREFETCH": False, "READER_GROUP": None}]
    assert all(r["knobs"]["BWD_DQ_SECOND_PASS"] is False for r in info["rows"])
    assert json.loads((tmp_path / "b.json").read_text())["rows"] == info["rows"]
    assert "READER_GROUP=None, PREFETCH=False" in capsys.readouterr().out


def test_gpu_check_cases_hold_every_pair_of_knob_values():
    """The default read cases of gpu_check.py (few: each compiles its own kernels on a GPU whose
    minutes are counted) still meet every pair of values of any two knobs."""
    import itertools

    import gpu_check

    cases = gpu_check.read_cases(full=False)
    levels = [gpu_check.SHAPES, (True, False), ("softmax", "sigmoid"), (False, True)]
    assert len(cases) == 8 and len(gpu_check.read_cases(full=True)) == 32
    for i, j in itertools.combinations(range(4), 2):
        assert {(c[i], c[j]) for c in cases} == set(itertools.product(levels[i], levels[j])), (i, j)


def test_op_bench_implementations_agree(tmp_path):
    out = tmp_path / "ob.json"
    info = op_bench.main(["--sublayers", "4", "--block-size", "2", "--tokens", "32", "--d", "16", "--reps", "1",
                          "--warmup", "0", "--only", "reference eager,torch path two-phase", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["reference eager", "torch path two-phase"] and info["rows"] == rows
    assert all(r["max_abs_diff_vs_reference"] <= 1e-5 for r in rows)  # fp32


@pytest.mark.parametrize("main, argv, message", [
    (model_bench.main, ["--variants", "block,nope"], "--variants: unknown nope; allowed: baseline,"),
    (model_bench.main, ["--variants", "block", "--layers", "1"], "--variants block: residual.block_size=4 must be"),
    (model_bench.main, ["--variants", "block", "--blocks", "0"], "--blocks 0: the number of blocks must be at least 1"),
    (op_bench.main, ["--only", "nope", "--tokens", "8", "--d", "8"], "--only: no implementation 'nope' here; allowed:"),
    (decode_bench.main, ["--new", "0"], "--new 0: allowed: a whole number from 1"),
    (decode_bench.main, ["--variants", "nope"], "--variants: unknown nope; allowed: baseline,"),
    (decode_bench.main, ["--layers", "1"], "residual.block_size=4 must be"),
])
def test_bad_arguments_exit_2_with_one_error_line(main, argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--json", str(tmp_path / "x.json")])
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0]
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow  # in CI's second step (.ci/run): keeps the default run under 10 minutes
def test_gpu_check_script_runs_under_the_triton_interpreter():
    """benchmarks/gpu_check.py is what run_gpu.sh first runs on a GPU; --smoke runs the same checks
    on CPU under TRITON_INTERPRET=1, so the script cannot rot unseen on a machine without one."""
    pytest.importorskip("triton")
    import subprocess

    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke"], cwd=ROOT,
                       capture_output=True, text=True, timeout=1200)  # a hang guard: ~6 min alone on a slow host, 10+ beside a second worker
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    lines = r.stdout.splitlines()
    assert lines[-1] == "ALL OK" and not any(line.startswith("FAIL") for line in lines)
    # reads (8 cases, output and gradients, two dtypes); schedules (5 variants: per read vs torch,
    # two-phase vs per read, reader groups and each switch vs two-phase); training
    from attnres.kernels.triton_kernels import SWITCHES

    assert sum(line.startswith("ok ") for line in lines) == 2 * 8 * 2 + 5 * (3 + len(SWITCHES)) + 2


def test_op_bench_peak_memory_is_measured_above_the_inputs_alone(monkeypatch):
    """The CUDA peak is taken above the memory allocated before the timed steps: that level must
    hold the inputs only, not the gradients the last warm-up step left on them (at the GPU shape,
    33 x 16k x 2048 bf16 = 2.1 GiB, which would be subtracted from every implementation's peak)."""
    import torch

    inputs = op_bench.make_inputs(4, 32, 16, torch.float32, torch.device("cpu"))
    leaves = [inputs[0], *inputs[1], inputs[2], inputs[3]]
    grads_at_base = []

    class Event:
        def __init__(self, **kwargs):
            pass

        def record(self):
            pass

        def elapsed_time(self, other):
            return 1.0

    def memory_allocated():
        grads_at_base.append([t.grad is not None for t in leaves])
        return 0

    for name, fake in dict(synchronize=lambda: None, reset_peak_memory_stats=lambda: None,
                           max_memory_allocated=lambda: 0, memory_allocated=memory_allocated, Event=Event).items():
        monkeypatch.setattr(torch.cuda, name, fake)
    op_bench.bench(op_bench.reference(op_bench.depth_read, 2), inputs, reps=1, warmup=1, cuda=True)
    assert grads_at_base == [[False] * len(leaves)]


def test_model_bench_stopped_in_its_memory_pass_still_reports_the_rounds(tmp_path):
    """run_gpu.sh's time limit (SIGTERM) landing in the memory pass, after every round was timed:
    the table and the JSON of the rounds are written, without memory figures (not a process
    killed by SIGTERM's default action with nothing written)."""
    import subprocess

    out = tmp_path / "mb.json"
    script = (
        "import os, signal, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "import model_bench\n"
        "real = model_bench.state_bytes\n"
        "def state_bytes(*args):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(*args)\n"
        "model_bench.state_bytes = state_bytes\n"
        "model_bench.main(['--variants', 'block', '--layers', '2', '--batch', '2', '--seq-len', '16', '--rounds', '2',\n"
        f"                 '--warmup', '1', '--threads', '1', '--json', {str(out)!r}])\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads(out.read_text())
    assert info["rounds"] == 2 and all(r["step_ms"] > 0 and "peak_mib" not in r for r in info["rows"])
    assert "interrupted in the memory pass" in r.stderr


def test_the_gpu_benchmarks_run_without_the_harness_config_stack(tmp_path):
    """A lent GPU machine's image has torch and Triton but no Hydra, OmegaConf, MLflow or Optuna,
    and nothing can be installed there: the scripts run_gpu.sh calls must import without them
    (model_bench took the block size for N blocks from harness.config, which needs OmegaConf).
    Here they are made unimportable; model_bench runs a toy model with --blocks."""
    import subprocess

    blocked = "import sys, runpy\nfor m in ('hydra', 'omegaconf', 'mlflow', 'optuna'):\n    sys.modules[m] = None\n"
    run = blocked + "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"
    bench = ROOT / "benchmarks"
    for argv in ([str(bench / "model_bench.py"), "--variants", "block", "--layers", "2", "--blocks", "2",
                  "--batch", "1", "--seq-len", "8", "--rounds", "1", "--warmup", "1", "--json",
                  str(tmp_path / "m.json")],
                 [str(bench / "op_bench.py"), "--help"], [str(bench / "gpu_check.py"), "--help"],
                 [str(bench / "tile_sweep.py"), "--help"], [str(bench / "decode_bench.py"), "--help"],
                 [str(bench / "bars.py"), "--help"]):
        r = subprocess.run([sys.executable, "-c", run, *argv], capture_output=True, text=True, timeout=300,
                           cwd=tmp_path)
        assert r.returncode == 0, f"{argv[0]}: {r.stderr[-2000:]}"
    from harness.config import block_size_of

    assert json.loads((tmp_path / "m.json").read_text())["block_size"] == block_size_of(2, 2) == 2


def test_model_bench_profile_names_each_variants_costliest_operators(tmp_path, capsys):
    """--profile N: one profiled step per variant after the rounds, its N costliest operators (CPU;
    kernels on CUDA) by self time, and their summed time against the step's wall time."""
    info = model_bench.main(["--variants", "block", "--layers", "2", "--batch", "2", "--seq-len", "16",
                             "--rounds", "1", "--warmup", "1", "--profile", "3", "--json", str(tmp_path / "p.json")])
    assert set(info["profiles"]) == {"baseline", "block"}
    for prof in info["profiles"].values():
        assert len(prof["top"]) == 3 and prof["busy_ms"] > 0 and prof["wall_ms"] > 0
        ms = [r["ms"] for r in prof["top"]]
        assert ms == sorted(ms, reverse=True) and all(r["calls"] >= 1 for r in prof["top"])
    assert json.loads((tmp_path / "p.json").read_text())["profiles"]["block"]["top"] == info["profiles"]["block"]["top"]
    out = capsys.readouterr().out
    assert "# block: one profiled step" in out and "the costliest 3:" in out


@pytest.mark.slow  # compiles a dozen Triton kernels to cubins (about 20 s)
def test_kernel_resources_counts_registers_of_the_kernels_a_step_launches(tmp_path):
    """kernel_resources.py compiles, for sm_90a and without a GPU, every Triton kernel one block
    step launches and reads registers and occupancy from the cubins, every autotuning candidate (4 and
    8 warps, tiles within the budget); --triton READER_GROUP=1 makes every read launch one reader, the backward's
    later launches accumulating; --triton BWD_DQ_SECOND_PASS=false (the default's opposite) reaches the backward. In a child process: it replaces Triton's active driver for good."""
    import subprocess

    pytest.importorskip("triton")
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import kernel_resources as kr; "
            "print(json.dumps([kr.main(['--d-model', '64', '--heads', '2', '--layers', '2', '--block-size', '2']), "
            "kr.main(['--d-model', '64', '--heads', '2', '--layers', '2', '--block-size', '2', '--triton', 'READER_GROUP=1']), "
            "kr.main(['--d-model', '64', '--heads', '2', '--layers', '2', '--block-size', '2', '--triton', 'BWD_DQ_SECOND_PASS=false'])]))")
    # two-phase: its phase-one reads launch 2 and 3 readers (S = 2 and the output read)
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "ATTNRES_SCHEDULE": "two_phase"}
    r = subprocess.run([sys.executable, "-c", code, str(ROOT / "benchmarks")], capture_output=True, text=True,
                       env=env, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    default, single, second = json.loads(r.stdout.strip().splitlines()[-1])
    names = {row["kernel"] for row in default}
    assert {"_read_fwd_kernel", "_read_bwd_kernel", "_inv_rms_fwd_kernel"} <= names, names
    for row in default:
        assert 0 < row["registers"] <= 255 and 0 < row["occupancy"] <= 1 and row["programs_per_sm"] >= 1, row
    for kernel, most in (("_read_fwd_kernel", 8192), ("_read_bwd_kernel", 4096)):
        rows = [row for row in default if row["kernel"] == kernel]
        assert {row["warps"] for row in rows} == {4, 8}, rows
        assert all(row["spec"]["R_PAD"] * row["spec"]["BLOCK_T"] * row["spec"]["W_PAD"] <= most for row in rows), rows
    reads = lambda rows: [row for row in rows if row["kernel"].startswith("_read_")]  # noqa: E731
    assert {row["spec"]["R"] for row in reads(default)} == {1, 2, 3} and {row["spec"]["R"] for row in reads(single)} == {1}
    assert any(row["spec"].get("ACCUMULATE") for row in single) and not any(row["spec"].get("ACCUMULATE") for row in default)
    backwards = lambda rows: [row for row in rows if row["kernel"] == "_read_bwd_kernel"]  # noqa: E731
    assert all(row["spec"]["DQ_SECOND_PASS"] for row in backwards(default))  # the default: on
    assert not any(row["spec"]["DQ_SECOND_PASS"] for row in backwards(second))


@pytest.mark.slow  # compiles the step's Triton kernels to cubins
def test_host_time_times_both_schedules_with_launches_that_run_nothing(tmp_path):
    """host_time.py: op_bench's step on CPU tensors with every kernel compiled for sm_90a and launched
    as a no-op, both schedules timed; the kernels it compiled are the read and 1/rms kernels. In a
    child process (the stand-in driver stays active for good)."""
    import subprocess

    pytest.importorskip("triton")
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import host_time; "
            "print(json.dumps(host_time.main(['--sublayers', '4', '--block-size', '2', '--d', '64', '--reps', '2'])))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code, str(ROOT / "benchmarks")], capture_output=True, text=True,
                       env=env, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    times, names = result["ms"], result["kernels"]
    assert set(times) == {"two_phase", "per_read"} and all(ms > 0 for ms in times.values()), times
    assert names == ["_inv_rms_fwd_kernel", "_read_bwd_kernel", "_read_fwd_kernel"], names
    assert "two_phase: host" in r.stdout and "per_read : host" in r.stdout
