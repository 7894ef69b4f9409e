"""Whether a file can serve as a SQLite tracking store: read by the harness before a run opens it
and by the analysis before it exports one, so a damaged file is one line, not a SQLAlchemy trace.
Standard library only: the analysis runs where neither torch nor the harness is installed."""
from __future__ import annotations

from pathlib import Path

SQLITE_FULL_CHECK_BYTES = 1 << 30  # above this a full scan at every start costs seconds: the schema alone is read


def sqlite_damage(db: Path) -> str | None:
    """What makes `db` unusable as a SQLite store, in a few words naming it, or None (absent, empty:
    SQLite starts a new one; unreadable: the client's own error says more). A folder, another kind
    of file, a copy cut short or a damaged page: MLflow's own error is a SQLAlchemy traceback
    ("database disk image is malformed"), after a run folder was made."""
    import sqlite3

    if db.is_dir():
        return f"{db} is not a SQLite database (a folder)"
    try:
        with open(db, "rb") as handle:
            head = handle.read(100)
        size = db.stat().st_size
    except OSError:
        return None
    if not head:
        return None
    if head[:16] != b"SQLite format 3\x00":
        return f"{db} is not a SQLite database (another kind of file)"
    page = int.from_bytes(head[16:18], "big") or 65536  # (1 stands for 65536)
    pages = int.from_bytes(head[28:32], "big")
    counted = head[24:28] == head[92:96]  # SQLite's rule for when the header's page count holds
    if len(head) < 100 or (counted and size < page * pages):
        return f"{db} is cut short ({size} bytes; its header says {page * pages}): a partial copy or a full disk"
    check = "quick_check(1)" if size <= SQLITE_FULL_CHECK_BYTES else "schema_version"
    try:
        connection = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
        try:
            verdict = connection.execute(f"PRAGMA {check}").fetchone()
            connection.execute("SELECT count(*) FROM sqlite_master").fetchone()
        finally:
            connection.close()
    except sqlite3.DatabaseError as error:
        if "locked" in str(error) or "unable to open" in str(error):
            return None  # in use, or not readable: not damage; the client waits or says why
        return f"{db} is a damaged SQLite database ({error})"
    if check.startswith("quick_check") and verdict and verdict[0] != "ok":
        return f"{db} is a damaged SQLite database ({' '.join(str(verdict[0]).split())[:200]})"
    return None

