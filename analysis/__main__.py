"""Command line: ``python -m analysis {report,export,merge,noise,robustness} ...``.

Exit status: 0 on success; 2 on bad input (missing file, unknown experiment, no runs, bad
arguments), with one line on stderr naming the problem; 1 when the report was written but a
section failed (the sections that failed are named).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

import pandas as pd

from .runs import AnalysisInputError, export_snapshot, import_snapshot, load_runset, merge_snapshots


def _role(text: str) -> tuple[str, str]:
    from .report import ROLES

    sweep, sep, role = text.partition("=")
    if not sep or role not in ROLES:
        raise argparse.ArgumentTypeError(f"expected SWEEP=SECTION with SECTION one of "
                                         f"{', '.join(ROLES)}")
    return sweep, role


def _source(p: argparse.ArgumentParser, snapshot: bool):
    src = p.add_mutually_exclusive_group()
    src.add_argument("--tracking-uri", help="MLflow tracking URI, e.g. sqlite:///mlflow.db (default: "
                                            "$MLFLOW_TRACKING_URI, else <project root>/mlflow.db, "
                                            "where run.py writes)")
    if snapshot:
        src.add_argument("--snapshot", help="run CSV written by `export` (instead of MLflow)")
    p.add_argument("--experiment", action="append", default=[], metavar="NAME",
                   help="MLflow experiment (= sweep name); repeat for several; default: all")
    p.add_argument("--filter", default="", metavar="MLFLOW_FILTER",
                   help="MLflow filter string, e.g. \"tags.attnres.variant = 'block'\"")


def _default_tracking_uri() -> str:
    """The store run.py writes to, as the README's environment table promises for analysis too:
    $MLFLOW_TRACKING_URI, else <project root>/mlflow.db. harness.config.default_tracking_uri
    holds the rule, but analysis imports no harness code (it runs where only a snapshot exists),
    so this is its copy; tests/test_analysis_report.py checks that the two agree."""
    return (os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{Path(__file__).resolve().parents[1] / 'mlflow.db'}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m analysis",
        description="Attention Residuals runs → the paper's tables and figures beside ours, and "
                    "REPORT.md (docs/ANALYSIS.md).")
    sub = ap.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="tables, figures and REPORT.md from runs")
    _source(rep, snapshot=True)
    rep.add_argument("--out", required=True, help="output folder (e.g. report/; results/ is the "
                                                  "committed study)")
    rep.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples (default 1000)")
    rep.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    rep.add_argument("--multiplier-at", type=float, default=None, metavar="PFLOPS_DAYS",
                     help="compute at which the multiplier is read (default: largest scaling run)")
    rep.add_argument("--role", type=_role, action="append", default=[], metavar="SWEEP=SECTION",
                     help="assign a sweep to a section (ablation, block_size, scaling, arch, "
                          "multihop, tuned_lr, robustness)")
    rep.add_argument("--paper-dir", default=None, help="folder of the paper's CSVs "
                     "(default: results/paper of this repository)")
    noi = sub.add_parser("noise", help="noise study of one recipe: seed σ, same-seed-difference "
                                       "σ, minimum detectable effects, seeds for a target Δ")
    _source(noi, snapshot=True)
    noi.add_argument("--out", required=True, help="output folder (noise_study.csv/.md/.png)")
    noi.add_argument("--sweep", default=None, help="only the runs of this sweep (e.g. ablation)")
    noi.add_argument("--baseline", default="baseline", help="variant compared against (default "
                                                            "baseline)")
    noi.add_argument("--variant", action="append", default=[], metavar="NAME",
                     help="variant compared with the baseline; repeat (default: every other)")
    noi.add_argument("--target", type=float, default=0.03, metavar="NATS",
                     help="Δ to size seeds for (default 0.03); an input, never the observed Δ")
    noi.add_argument("--seeds", default="2,4,8,16", metavar="N,N,...",
                     help="seed counts at which to give the minimum detectable effect")
    noi.add_argument("--metric", default="final_val_loss", help="run column (default "
                                                                "final_val_loss)")
    exp = sub.add_parser("export", help="snapshot runs into a CSV (+ history and instrumentation)")
    _source(exp, snapshot=False)
    exp.add_argument("--out", required=True, help="CSV path, e.g. results/runs.csv")
    rob = sub.add_parser("robustness", help="each comparison re-judged at the nuisance settings a "
                                            "declaration names; --train adds the missing seeds")
    from .robustness import add_arguments

    add_arguments(rob)
    mer = sub.add_parser("merge", help="one snapshot from snapshots of different stores")
    mer.add_argument("snapshots", nargs="+", metavar="CSV", help="run CSVs written by `export`")
    mer.add_argument("--out", required=True, help="CSV path of the merged snapshot")
    mer.add_argument("--without-sweep", action="append", default=[], metavar="SWEEP",
                     help="leave this sweep's runs out (repeatable): a sweep re-run at a new recipe")
    return ap


def _check_out(out: Path, folder: bool) -> None:
    """--out can be written: not a file where a folder goes (or the reverse), and the nearest
    existing folder above it writable; checked before the (slow) loading of runs."""
    if out.exists() and out.is_dir() != folder:
        raise AnalysisInputError(f"--out {out} is {'a file' if folder else 'a folder'}")
    above = out if folder else out.parent
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise AnalysisInputError(f"--out {out}: {above} is a file, not a folder")
    try:  # a real probe: permissions alone do not tell (root, read-only mounts, /proc)
        os.rmdir(tempfile.mkdtemp(prefix=".analysis-probe-", dir=above))
    except OSError as exc:
        raise AnalysisInputError(f"--out {out}: cannot write in {above} ({exc.strerror or exc})") from None


MOST_SEEDS = 1000  # a seed count beyond any study; the power curves are drawn up to it


def _noise_options(args) -> None:
    """Check the noise study's options (before the runs are loaded); ``args.ns`` set."""
    try:
        args.ns = sorted({int(x) for x in args.seeds.split(",") if x.strip()})
    except ValueError:
        raise AnalysisInputError(f"--seeds {args.seeds!r}: expected whole numbers, e.g. 2,4,8") from None
    if not args.ns or min(args.ns) < 2 or max(args.ns) > MOST_SEEDS:
        raise AnalysisInputError(f"--seeds {args.seeds!r}: each count must be >= 2 and <= {MOST_SEEDS}")
    if not 0 < args.target < math.inf:
        raise AnalysisInputError(f"--target {args.target}: must be a positive finite Δ in the metric's unit")


def _noise(args, runset) -> int:
    from . import noise
    from .ablation import to_markdown
    from .report import _restricted

    runs = runset.runs[runset.runs["status"] == "FINISHED"]
    if args.sweep is not None:
        runs = runs[runs["sweep"] == args.sweep]
    if args.metric not in runs or not pd.api.types.is_numeric_dtype(runs[args.metric]):
        numeric = [c for c in runs if pd.api.types.is_numeric_dtype(runs[c]) and "loss" in c]
        raise AnalysisInputError(f"--metric {args.metric}: not a numeric column of the runs "
                                 f"(allowed, e.g.: {', '.join(numeric)})")
    if runs.empty:
        raise AnalysisInputError("no finished runs" + (f" in sweep {args.sweep!r}" if args.sweep else ""))
    runs, note = _restricted(runs)
    have = set(runs["variant"])
    wanted = args.variant or sorted(have - {args.baseline})
    missing = [v for v in [args.baseline, *wanted] if v not in have]
    if missing or not wanted:
        raise AnalysisInputError(f"variant(s) {', '.join(missing) or '(none to compare)'} not among "
                                 f"the runs; allowed: {', '.join(sorted(have))}")
    table = noise.noise_table(runs, args.baseline, wanted, args.metric, tuple(args.ns), args.target)
    out = Path(args.out)
    paths = noise.write(table, out) + noise.plot(table, out, ns_max=max(32, max(args.ns)))
    est = noise.estimators(runs, runset.histories, args.baseline, wanted, target=args.target)
    if len(est):
        paths += [out / "noise_estimators.csv"]
        est.to_csv(paths[-1], index=False, float_format="%.6g")
    if note:
        print(f"note: {note}")
    print(to_markdown(noise.shown(table)), end="")
    if len(est):
        print("\nfinal-loss estimators (σ of same-seed differences; seeds for 80% power at the "
              "target, and for a paired interval within ±target):")
        print(to_markdown(est.round(4)), end="")
    print("wrote " + ", ".join(map(str, paths)))
    return 0


def _robustness(args) -> int:
    from . import robustness

    try:
        if args.out:
            _check_out(Path(args.out).expanduser().absolute(), folder=True)
        return robustness.main(args, _default_tracking_uri())
    except AnalysisInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # a report is staged and moved into place whole: --out is as it was
        print("interrupted: a report's --out is left as it was", file=sys.stderr)
        return 130


def _main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.command == "robustness":
        return _robustness(args)
    try:
        _check_out(Path(args.out).expanduser().absolute(), folder=args.command not in ("export", "merge"))
        if args.command == "merge":
            runset = merge_snapshots(args.snapshots, args.without_sweep)
            paths = export_snapshot(runset, args.out)
            print(f"wrote {len(runset.runs)} runs to {', '.join(map(str, paths))}")
            for note in runset.notes:  # what was left out of the written snapshot
                print(f"note: {note}", file=sys.stderr)
            return 0
        if args.command == "noise":
            _noise_options(args)
        if args.command == "report":  # check options before the (slow) loading of runs
            if args.n_boot < 0:
                raise AnalysisInputError("--n-boot must be >= 0")
            if args.multiplier_at is not None and not 0 < args.multiplier_at < math.inf:
                raise AnalysisInputError("--multiplier-at must be a positive compute in "
                                         "PFLOP/s-days")
        if getattr(args, "snapshot", None):
            if args.experiment or args.filter:
                raise AnalysisInputError("--experiment and --filter apply to --tracking-uri, "
                                         "not to --snapshot")
            runset = import_snapshot(args.snapshot)
        else:
            try:
                runset = load_runset(args.tracking_uri or _default_tracking_uri(), args.experiment,
                                     args.filter)
            except AnalysisInputError as exc:
                if args.tracking_uri is not None:
                    raise
                raise AnalysisInputError(f"{exc} (the default store; allowed: --tracking-uri URI, "
                                         "$MLFLOW_TRACKING_URI or --snapshot CSV)") from None
        if args.command == "noise":
            return _noise(args, runset)
        if args.command == "export":
            paths = export_snapshot(runset, args.out)
            print(f"wrote {len(runset.runs)} runs to {', '.join(map(str, paths))}")
            for note in runset.notes:  # what was left out of the written snapshot
                print(f"note: {note}", file=sys.stderr)
            return 0
        unknown = sorted({sweep for sweep, _ in args.role} - set(runset.runs["sweep"].dropna()))
        if unknown:  # a misspelt sweep would leave its runs in the section their name gives
            raise AnalysisInputError(f"--role {', '.join(unknown)}: no such sweep among the runs "
                                     f"(allowed: {', '.join(sorted(runset.runs['sweep'].dropna().unique()))})")
        from .report import Options, build_report

        opts = Options(n_boot=args.n_boot, seed=args.seed, multiplier_at=args.multiplier_at,
                       roles=dict(args.role), paper_dir=args.paper_dir)
        path, errors = build_report(runset, args.out, opts)
    except AnalysisInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk, a folder removed under us: after the checks above
        print(f"error: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    if errors:
        print(f"error: {len(errors)} section(s) failed: " + "; ".join(errors), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
