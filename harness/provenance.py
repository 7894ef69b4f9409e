"""Where a run came from: the code (git commit, diff, a source snapshot) and the environment.

A working tree is usually dirty, so the commit is kept with `git diff HEAD`, the untracked files and
a tar.gz of the project's source; `code_digest` hashes all three, so a resumed run notices changed
code. Computed once per process, and never fails a run (a missing git is a note).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import io
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harness.config import PROJECT_ROOT

SNAPSHOT_SUFFIXES = (".py", ".yaml", ".yml", ".toml", ".md", ".cfg", ".txt", ".c", ".h", ".sh")  # .c/.h: the CPU kernels
SNAPSHOT_MAX_FILE = 1_000_000  # bytes: data files that happen to be .txt are not code


@dataclass(frozen=True)
class CodeState:
    commit: str
    diff: str
    untracked: tuple[str, ...]
    snapshot: bytes  # tar.gz of the source files
    digest: str


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def _source_files() -> list[str]:
    listed = _git("ls-files", "--cached", "--others", "--exclude-standard", "-z")
    if listed is not None:
        names = [n for n in listed.split("\0") if n]
    else:  # no git: the project's own folders
        names = [
            str(p.relative_to(PROJECT_ROOT)) for top in ("attnres", "harness", "analysis", "hydra_plugins",
                                                         "conf", "sweeps", "benchmarks")
            for p in (PROJECT_ROOT / top).rglob("*") if p.is_file()
        ] + [n for n in ("run.py", "pyproject.toml") if (PROJECT_ROOT / n).exists()]
    keep = []
    for name in sorted(set(names)):
        path = PROJECT_ROOT / name
        if path.suffix in SNAPSHOT_SUFFIXES and path.is_file() and path.stat().st_size <= SNAPSHOT_MAX_FILE:
            keep.append(name)
    return keep


def _snapshot(names: list[str]) -> bytes:
    buf = io.BytesIO()
    # mtime=0 and sorted names: the same source gives the same bytes (and digest)
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for name in names:
            data = (PROJECT_ROOT / name).read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _untracked() -> tuple[str, ...]:
    """Untracked files git does not ignore, less the bookkeeping of run folders (a
    train.checkpoint_dir inside the project under another name than the ignored checkpoints/):
    a folder holding both `.lock` and `run.json` is a run folder, not code."""
    names = [n for n in (_git("ls-files", "--others", "--exclude-standard") or "").splitlines() if n]

    def in_run_folder(name: str) -> bool:
        folder = (PROJECT_ROOT / name).parent
        return (folder / ".lock").is_file() and (folder / "run.json").is_file()

    return tuple(n for n in names if not in_run_folder(n))


@functools.lru_cache(maxsize=1)
def code_state() -> CodeState:
    commit = (_git("rev-parse", "HEAD") or "").strip() or "(not a git checkout, or git is missing)"
    diff = _git("diff", "HEAD", "--no-color") or ""
    untracked = _untracked()
    names = _source_files()
    h = hashlib.sha256()
    for name in names:
        h.update(name.encode() + b"\0" + (PROJECT_ROOT / name).read_bytes() + b"\0")
    digest = hashlib.sha256(f"{commit}\0{diff}\0{h.hexdigest()}".encode()).hexdigest()
    return CodeState(commit, diff, untracked, _snapshot(names), digest)


# The files that define what a run computes: the model, the data, the loop, the entry point.
# A finished or resumable run recorded their hashes; a rerun compares (harness/job.py).
RUN_CODE = ("attnres", "harness", "run.py")


def run_code_files() -> dict[str, str]:
    """sha256 of every source file of RUN_CODE in the working tree, by path (commit and diff in
    one: what is on disk is what runs). Read each time: a rerun must see an edit made since."""
    out = {}
    for top in RUN_CODE:
        root = PROJECT_ROOT / top
        paths = [root] if root.is_file() else sorted(root.rglob("*"))
        for path in paths:
            if path.is_file() and path.suffix in (".py", ".c", ".h") and "__pycache__" not in path.parts:
                out[path.relative_to(PROJECT_ROOT).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def changed_code_files(recorded: dict[str, str], now: dict[str, str]) -> list[str]:
    """The files of RUN_CODE added, removed or edited between two run_code_files()."""
    return sorted(name for name in set(recorded) | set(now) if recorded.get(name) != now.get(name))


@functools.lru_cache(maxsize=1)
def pip_freeze() -> str:
    """`pip freeze`'s name==version lines from importlib.metadata, without a pip subprocess."""
    lines = set()
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            lines.add(f"{name}=={dist.version}")
    return "\n".join(sorted(lines, key=str.lower)) + "\n"


def log_code(tracker, prefix: str = "code") -> None:
    """Artifacts code/git_commit.txt, code/git_diff.patch, code/untracked.txt, code/source.tar.gz."""
    state = code_state()
    tracker.log_text(state.commit + "\n", f"{prefix}/git_commit.txt")
    tracker.log_text(state.diff, f"{prefix}/git_diff.patch")
    tracker.log_text("\n".join(state.untracked) + "\n", f"{prefix}/untracked.txt")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "source.tar.gz"
        path.write_bytes(state.snapshot)
        tracker.log_file(str(path), prefix)
