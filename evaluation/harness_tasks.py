"""Running lm-evaluation-harness tasks on a loaded model, and flattening their results.

Tasks run through `lm_eval.simple_evaluate` with the `attnres` adapter around the model already in
memory, so the numbers equal those of lm_eval's own CLI. Public tasks download their data on first
use; offline, that is one line naming the task.
"""
from __future__ import annotations

import math
import re
from typing import Optional

_KEY = re.compile(r"[^\w\-. /:]")


def run_tasks(
    model,
    config: dict,
    tasks: list[str],
    *,
    num_fewshot: Optional[int] = None,
    limit: Optional[float] = None,
    include_path: Optional[str] = None,
    batch_size: int = 16,
    seed: int = 0,
    tokenizer=None,
    bootstrap_iters: int = 100000,
) -> dict:
    """lm-eval's results dict (without per-sample logs) for `tasks` on an in-memory model."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from .lm_eval_adapter import AttnResLM

    lm = AttnResLM(pretrained=model, config=config, batch_size=batch_size, tokenizer=tokenizer)
    manager = None
    if include_path:
        # Indexing lm-eval's thousands of bundled task files takes seconds: skip it when the
        # include path alone defines every task asked for.
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if not all(t in manager.all_tasks for t in tasks):
            manager = None
    manager = manager or TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s) {', '.join(unknown)}; list them with `lm_eval ls tasks`")
    try:
        results = lm_eval.simple_evaluate(
            model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
            log_samples=False, bootstrap_iters=bootstrap_iters,
        )
    except (ConnectionError, OSError) as e:
        raise RuntimeError(f"lm-eval could not load the data of {', '.join(tasks)} (offline?): {_one_line(e)}") from None
    if results is None:
        raise RuntimeError("lm-eval returned no results")
    results.pop("samples", None)
    return results


def flatten_metrics(results: dict) -> dict[str, float]:
    """{"<task>/<metric>": value} from lm-eval's `results` and `groups` sections."""
    out: dict[str, float] = {}
    for section in ("results", "groups"):
        for task, metrics in (results.get(section) or {}).items():
            for name, value in metrics.items():
                if name == "alias" or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                if math.isnan(float(value)):
                    continue
                # MLflow keys may not hold commas: "acc,none" → "acc", "exact_match,strict-match" →
                # "exact_match_strict-match".
                metric, _, filt = name.partition(",")
                key = metric if filt in ("", "none") else f"{metric}_{filt}"
                out[_KEY.sub("_", f"{task}/{key}")] = float(value)
    return out


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]
