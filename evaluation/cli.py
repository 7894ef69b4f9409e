"""`python -m evaluation <path or run id>`: every evaluation of a trained model in one command.

    python -m evaluation 3f2a…c9 --probe --tasks hellaswag,lambada_openai,wikitext
    python -m evaluation out/model --log-to 3f2a…c9 --tasks wikitext --limit 100

Prints `eval/<task>/<metric> value` lines and logs them into the run; bad input is one line and exit
status 2 before anything is evaluated, a failure while evaluating one line and exit status 1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m evaluation", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="checkpoint folder or file, MLflow run id, or runs:/<run id>[/folder]")
    p.add_argument("--tasks", default="", help="comma-separated lm-eval tasks, e.g. hellaswag,lambada_openai,wikitext")
    p.add_argument("--probe", action="store_true", help="multi-hop probe accuracy per hop count")
    p.add_argument("--skip-heldout", action="store_true", help="do not compute held-out loss / bits per byte")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else run.py's <project root>/mlflow.db)")
    p.add_argument("--log-to", default=None, metavar="RUN_ID", help="log into this run (for a checkpoint folder)")
    p.add_argument("--no-log", action="store_true", help="do not log anything to MLflow")
    p.add_argument("--output", default=None, help="also write all results to this JSON file")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 … (default: CUDA when available)")
    p.add_argument("--batch-size", type=_positive, default=16)
    p.add_argument("--max-batches", type=_positive, default=None, help="held-out batches (default: the whole split)")
    p.add_argument("--seq-len", type=_positive, default=None, help="held-out window (default: the run's train.seq_len)")
    p.add_argument("--as-training", action="store_true",
                   help="held-out on exactly training's val/loss set (train.micro_batch_size, train.eval_batches)")
    p.add_argument("--data", action="append", default=[], metavar="KEY=VALUE", help="override a data setting (repeatable)")
    p.add_argument("--tokenizer", choices=("bytes", "gpt2"), default=None, help="default: implied by the vocabulary size")
    p.add_argument("--probe-max-per-hop", type=_positive, default=None)
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--limit", type=float, default=None, help="lm-eval: examples per task (a fraction if < 1)")
    p.add_argument("--include-path", default=None, help="lm-eval: folder of extra task YAML files")
    p.add_argument("--bootstrap-iters", type=int, default=100000, help="lm-eval: bootstrap samples for stderr")
    p.add_argument("--seed", type=int, default=0)
    return p


class _Refused(Exception):
    """One line on stderr and this exit status (2: bad input, nothing evaluated; 1: a failure)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        _check_arguments(args, tasks)
        source, data_cfg, seq_len, tokenizer = _open(args, tasks)
        batch_size, max_batches = _heldout_batches(args, source)
        metrics, artifacts = _evaluate(args, tasks, source, data_cfg, seq_len, tokenizer, batch_size, max_batches)
        _report(args, source, metrics, artifacts)
    except _Refused as refused:
        return _fail(str(refused), refused.code)
    return 0


def _check_arguments(args: argparse.Namespace, tasks: list[str]) -> None:
    """Bad arguments refused before anything loads."""
    if args.skip_heldout and not args.probe and not tasks:
        raise _Refused("nothing to evaluate: --skip-heldout without --probe or --tasks", 2)
    problem = device_problem(args.device) if args.device else None
    if problem:
        raise _Refused(f"--device {args.device}: {problem}", 2)
    # now, not after hours of lm-eval tasks with every result lost to a traceback
    problem = output_problem(Path(args.output)) if args.output else None
    if problem:
        raise _Refused(f"--output {args.output}: {problem}", 2)


def _open(args: argparse.Namespace, tasks: list[str]):
    """(the model's source, its data settings, the held-out window, its tokenizer or None)."""
    try:
        from attnres.io import CheckpointError

        from .source import data_settings, open_source
        from .tokenizer import TokenizerError, tokenizer_for

        source = open_source(args.source, device=args.device, tracking_uri=args.tracking_uri, log_to=args.log_to)
        data_cfg, seq_len = data_settings(source, args.data, args.seq_len)
        try:
            tokenizer = tokenizer_for(source.model.config.vocab_size, args.tokenizer)
        except TokenizerError as e:
            if args.tokenizer:  # asked for by name: the user's choice does not fit, not a detail to skip
                raise _Refused(f"--tokenizer {args.tokenizer}: {e}", 2) from None
            if tasks:
                raise
            # Held-out loss needs no tokenizer; only bits per byte does.
            print(f"evaluation: no bits per byte: {e}", file=sys.stderr)
            tokenizer = None
    except _Refused:
        raise
    except (CheckpointError, TokenizerError, ValueError) as e:
        raise _Refused(str(e), 2) from None
    except Exception as e:  # an unreachable tracking server, a corrupt download, …
        raise _Refused(f"{args.source}: {_one_line(e)}", 2) from None
    return source, data_cfg, seq_len, tokenizer


def _heldout_batches(args: argparse.Namespace, source) -> tuple[int, Optional[int]]:
    """(batch size, batches) of the held-out loss: the options', or training's (--as-training)."""
    if not args.as_training:
        return args.batch_size, args.max_batches
    train = source.config.get("train") if isinstance(source.config.get("train"), dict) else {}
    # micro_batch_size null means batch_size, as training reads it (harness/train.py)
    batch_size = train.get("micro_batch_size") or train.get("batch_size")
    max_batches = train.get("eval_batches")
    if not batch_size or not max_batches:
        raise _Refused(f"--as-training: {args.source} records no train.batch_size / train.eval_batches", 2)
    return batch_size, max_batches


def _evaluate(args, tasks, source, data_cfg, seq_len, tokenizer, batch_size, max_batches):
    """(metrics, artifacts) of the held-out loss, the probe and the lm-eval tasks asked for."""
    metrics: dict[str, float] = {}
    artifacts: dict[str, dict] = {}
    try:
        if not args.skip_heldout:
            from harness.data import DataError, load_data

            from .heldout import heldout_metrics

            try:
                data = load_data(data_cfg, seq_len)
            except DataError as e:
                raise _Refused(str(e), 2) from None
            found = heldout_metrics(source.model, data.val, seq_len, tokenizer, batch_size, max_batches)
            metrics.update({f"heldout/{k}": v for k, v in found.items()})
            artifacts["heldout"] = {**found, "seq_len": seq_len, "batch_size": batch_size,
                                    "max_batches": max_batches, "data_fingerprint": data.fingerprint}
        if args.probe:
            from .probe import probe_metrics

            found = probe_metrics(source.model, data_cfg, args.probe_max_per_hop)
            metrics.update({f"multihop/{k}": v for k, v in found.items()})
            artifacts["probe"] = found
        if tasks:
            artifacts["lm_eval"] = _lm_eval(args, tasks, source, tokenizer)
            from .harness_tasks import flatten_metrics

            metrics.update(flatten_metrics(artifacts["lm_eval"]))
    except _Refused:
        raise
    except ValueError as e:  # unknown task, a probe that does not fit the model, …
        raise _Refused(str(e), 2) from None
    except Exception as e:
        raise _Refused(_one_line(e), 1) from None
    return metrics, artifacts


def _lm_eval(args, tasks, source, tokenizer) -> dict:
    try:
        from .harness_tasks import run_tasks
    except ImportError as e:
        raise _Refused(f"--tasks needs lm-evaluation-harness ({e}); pip install 'lm-eval==0.4.13'", 2) from None
    return run_tasks(
        source.model, source.config, tasks, num_fewshot=args.num_fewshot, limit=args.limit,
        include_path=args.include_path, batch_size=args.batch_size, seed=args.seed, tokenizer=tokenizer,
        bootstrap_iters=args.bootstrap_iters,
    )


def _report(args: argparse.Namespace, source, metrics: dict[str, float], artifacts: dict[str, dict]) -> None:
    """Print the metrics, write --output, log into the run."""
    for key, value in sorted(metrics.items()):
        print(f"eval/{key} {value:.6g}")
    if args.output:
        from harness.checkpoint import atomic_write

        out, text = Path(args.output), json.dumps({"metrics": metrics, **artifacts}, indent=2, default=str)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            # A full disk mid-write must not leave a truncated JSON file that reads as a result.
            atomic_write(out, lambda tmp: tmp.write_text(text))
        except OSError as e:
            raise _Refused(f"--output {out}: cannot write ({e.strerror or e})", 1) from None
    if source.run_id and not args.no_log:
        from .mlflow_results import log_to_run
        from .source import store_gone

        if store_gone(source):  # MLflow would make an empty store in its place (the results are printed above)
            raise _Refused(f"not logged to run {source.run_id}: {store_gone(source)}", 1)
        try:
            log_to_run(source.run_id, source.tracking_uri, metrics, artifacts)
        except Exception as e:
            raise _Refused(f"could not log to run {source.run_id}: {_one_line(e)}", 1) from None
        print(f"logged {len(metrics)} metrics and eval/{{{','.join(artifacts)}}}.json to run {source.run_id}")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def device_problem(name: str) -> Optional[str]:
    """Why --device cannot be used here (None if it can): checked before anything is loaded (both commands)."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        return "not a device name; allowed: cpu, cuda, cuda:<index>"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available on this machine; allowed: cpu"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"this machine has {torch.cuda.device_count()} CUDA device(s)"
    elif device.type != "cpu":
        return f"{device.type} devices are not supported by the evaluation; allowed: cpu, cuda, cuda:<index>"
    return None


def output_problem(path: Path) -> Optional[str]:
    """Why --output cannot become a file (None if it can); missing folders are created later."""
    if path.is_dir():
        return "is a folder; allowed: a file path (missing folders are created)"
    existing = path.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK):
        return f"cannot write in {existing}"
    return None


def _fail(message: str, code: int) -> int:
    print(f"evaluation: {message}", file=sys.stderr)
    return code


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:400]
