"""Before Hydra starts, under torchrun: one output folder for all ranks, and no multirun.

Every rank runs Hydra, and ranks started either side of a second would name different `${now:...}`
folders, so rank 0's start time goes to all through the launch's TCP store (no shared disk needed).
Rank 0 alone writes `.hydra/` and `run.log`, the others `run_rank<N>.log`. `-m` under torchrun is
refused (exit 2): every process would launch the whole sweep.
"""
from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

from harness.config import rank, world_size

LAUNCH_TIME_ENV = "ATTNRES_LAUNCH_TIME"
_KEY = "attnres/launch_time"
_store = None  # rank 0's own store (no torchrun agent) must outlive this call: init_process_group reuses it


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def torchrun_overrides(argv: list[str]) -> list[str]:
    """The Hydra overrides this rank adds to the command line (none outside a multi-process launch).
    Sets ATTNRES_LAUNCH_TIME when the ranks must agree on the output folder."""
    world = world_size()
    if world <= 1:
        return []
    args = argv[1:]
    if any(a in ("-m", "--multirun") or a.replace("+", "").startswith("hydra.mode=MULTIRUN") for a in args):
        _fail(f"-m/--multirun under torchrun (WORLD_SIZE={world}): every process would launch the whole sweep; "
              "allowed: one run per torchrun command (loop over torchrun commands for a sweep, docs/DISTRIBUTED.md)")
    if any(a.lstrip("+").startswith(("hydra.run.dir=", "hydra/run=")) for a in args):
        pass  # the user named the folder: every rank already composes the same one
    elif LAUNCH_TIME_ENV not in os.environ:
        os.environ[LAUNCH_TIME_ENV] = agreed_launch_time()
    if rank() == 0:
        return []
    return ["hydra.output_subdir=null", f"hydra.job.name={Path(argv[0]).stem}_rank{rank()}"]


def agreed_launch_time(timeout_s: float = 300.0) -> str:
    """Rank 0's time.time() at start, as every rank of the launch reads it from the TCP store.
    Without torchrun's agent, rank 0 hosts the store, multi-tenant so init_process_group reuses it."""
    from torch.distributed import TCPStore

    global _store
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK") if k not in os.environ]
    if missing:
        _fail(f"WORLD_SIZE={world_size()} but {', '.join(missing)} unset: launch with "
              "`torchrun --nproc_per_node=N run.py ...`, or set hydra.run.dir=<one folder for all ranks>")
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent serves the store
    try:
        store = TCPStore(host, port, world_size(), is_master=not agent and rank() == 0,
                         timeout=timedelta(seconds=timeout_s), multi_tenant=not agent)
        if rank() == 0:
            store.set(_KEY, f"{time.time():.6f}")
        value = store.get(_KEY).decode()
    except (RuntimeError, OSError) as error:  # DistStoreError is a RuntimeError
        _fail(f"cannot agree on the output folder with rank 0 through {host}:{port} ({error}); "
              "set hydra.run.dir=<one folder for all ranks>")
    if not agent:
        _store = store
    return value
