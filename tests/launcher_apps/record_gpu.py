"""A Hydra job that records the GPU it was given and when it ran, for the launcher tests.

Each job appends one JSON line {job, cuda_visible_devices, start, end, peers_seen, pid} to the
file named by LAUNCHER_TEST_RECORD. It first waits (at most 30 s) until two jobs have started
(a file each in the folder LAUNCHER_TEST_BARRIER), so that jobs allowed to run at once provably
do however slowly each process starts; then it sleeps LAUNCHER_TEST_SLEEP seconds, so that two
jobs given the same GPU would overlap in time. No torch, no data: it starts fast.
"""
import json
import os
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig


def _wait_for_a_peer(barrier: Path, job: int) -> int:
    barrier.mkdir(exist_ok=True)
    (barrier / str(job)).touch()
    deadline = time.monotonic() + 30
    while len(os.listdir(barrier)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(os.listdir(barrier))


@hydra.main(version_base="1.3", config_path=None, config_name=None)
def main(cfg: DictConfig) -> float:
    start = time.time()
    peers = _wait_for_a_peer(Path(os.environ["LAUNCHER_TEST_BARRIER"]), cfg.job)
    time.sleep(float(os.environ.get("LAUNCHER_TEST_SLEEP", "1.0")))
    line = {"job": cfg.job, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": start,
            "end": time.time(), "peers_seen": peers, "pid": os.getpid()}
    with open(os.environ["LAUNCHER_TEST_RECORD"], "a") as record:  # one short O_APPEND write per job
        record.write(json.dumps(line) + "\n")
    return float(cfg.job)


if __name__ == "__main__":
    main()
