"""Before Hydra starts, under torchrun: one output folder for all ranks, and no multirun.

Every process of `torchrun --nproc_per_node=N run.py ...` runs run.py, so every process runs
Hydra, and Hydra names the run's folder from `${now:...}`: N processes started a few
milliseconds apart straddle a second often enough to write N folders. Design decisions:

- **Rank 0's clock names the folder.** hydra.run.dir uses `${attnres.now:...}` (harness/
  resolvers.py), which is Hydra's `${now:...}` unless ATTNRES_LAUNCH_TIME holds an agreed start
  time. Before Hydra parses the command line, rank 0 puts its time in the launch's TCP store
  (the one torchrun's agent serves at MASTER_ADDR:MASTER_PORT for init_process_group) and every
  rank reads it back, so all ranks compose the same folder. Nothing is written to the file
  system to agree, so it works the same on one node and on many, shared disk or not. Without
  torchrun's agent (a launcher that only sets the variables), rank 0 hosts the store itself, in
  multi-tenant mode so that init_process_group later reuses it. An explicit hydra.run.dir needs
  no agreement.
- **One writer of the folder's files.** Rank 0 writes Hydra's `.hydra/` copy of the config and
  `run.log`; the other ranks write no `.hydra/` (hydra.output_subdir=null) and log to
  `run_rank<N>.log` beside it (their own hydra.job.name), so no two processes write one file.
- **Multirun stays outside torchrun.** `-m` under torchrun would make N processes each launch
  the whole sweep; it is refused with one line (exit 2). A sweep of distributed runs is a loop of
  torchrun commands (docs/DISTRIBUTED.md).
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
    """Rank 0's time.time() at start, as every rank of the launch reads it from the TCP store."""
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
