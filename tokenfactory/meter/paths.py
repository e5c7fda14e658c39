"""The data directory every command that reads or writes the ledger shares (light: no heavy imports).

`--data-dir DIR` wins; else $TOKENFACTORY_DATA_DIR; else the platform's per-user data directory:
$XDG_DATA_HOME/tokenfactory (default ~/.local/share/tokenfactory) on Linux and other Unixes,
~/Library/Application Support/tokenfactory on macOS, %LOCALAPPDATA%\\tokenfactory on Windows.

The directory holds key digests and every tenant's usage, so it is private: created 0700, its files
0600, and an existing directory or file that others can read is tightened when we own it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

DATA_DIR_ENV = "TOKENFACTORY_DATA_DIR"
LEDGER_FILENAME = "ledger.db"
JOURNAL_STEM = "ledger-journal"
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def default_data_dir() -> Path:
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV]).expanduser()
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    else:
        base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "tokenfactory"


def resolve_data_dir(data_dir: str | Path | None) -> Path:
    """`data_dir` if given (the --data-dir flag), else default_data_dir()."""
    return Path(data_dir).expanduser() if data_dir else default_data_dir()


def ledger_path(data_dir: str | Path | None) -> Path:
    return resolve_data_dir(data_dir) / LEDGER_FILENAME


def journal_path(data_dir: str | Path | None, url: str | None = None) -> Path:
    """Where rows the database refused wait: one journal per database, so rows meant for a PostgreSQL
    URL never replay into the default SQLite file (or another server) sharing the directory. Pass the
    URL's password-free form: the journal is named by its digest, so a changed password keeps it."""
    if url is None:
        return resolve_data_dir(data_dir) / f"{JOURNAL_STEM}.jsonl"
    digest = hashlib.sha256(url.encode()).hexdigest()[:12]
    return resolve_data_dir(data_dir) / f"{JOURNAL_STEM}-{digest}.jsonl"


def make_private_dir(path: Path) -> None:
    """Create `path` (and its parents) with mode 0700, or tighten it if others can read it."""
    path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_mode & stat.S_ISVTX:  # /tmp and the like are shared on purpose: never close them
        logger.warning("data directory %s is a shared (sticky) directory; choose a private --data-dir", path)
        return
    _tighten(path, st, PRIVATE_DIR_MODE)


def make_private_file(path: Path, create: bool) -> None:
    """Create `path` empty with mode 0600 (when `create`), or tighten an existing one. SQLite gives its
    -wal and -shm files the database file's mode, so creating ledger.db first keeps those private too."""
    if create:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE))
        except FileExistsError:
            pass
    try:
        st = path.stat()
    except FileNotFoundError:
        return
    _tighten(path, st, PRIVATE_FILE_MODE)


def _tighten(path: Path, st: os.stat_result, mode: int) -> None:
    if not stat.S_IMODE(st.st_mode) & 0o077 or not hasattr(os, "geteuid"):
        return
    if st.st_uid != os.geteuid():
        logger.warning("%s is readable by others (mode %o) but not ours to tighten", path, stat.S_IMODE(st.st_mode))
        return
    try:
        os.chmod(path, stat.S_IMODE(st.st_mode) & mode)
    except OSError as e:  # a read-only filesystem or an immutable file: say so, and go on
        logger.warning("cannot tighten %s (mode %o): %s", path, stat.S_IMODE(st.st_mode), e.strerror or e)
        return
    logger.info("tightened %s from mode %o to %o", path, stat.S_IMODE(st.st_mode), stat.S_IMODE(st.st_mode) & mode)
