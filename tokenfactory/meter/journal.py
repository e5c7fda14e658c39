"""Where ledger rows go while the database refuses them, and how they come back exactly once.

    Ledger.record ──► database
         │ refused (read-only, disk full, locked, server gone) or too slow
         ▼
       held (memory) ──► journal file (append + fsync) ──► replay ──► database (idempotent insert)

The journal is JSON lines in the data directory (mode 0600), one {"v": 1, "row": {...}} per row.
Appends hold an exclusive flock and fsync before they return, so a journalled row survives SIGKILL and
power loss; a line cut short by a kill is skipped with a warning (and kept in `<journal>.rejected`),
never fatal. Replay renames the journal to `<journal>.replay-<unique>` under the same lock (appenders
start a fresh file), inserts its rows, then deletes it. A crash between the insert and the delete
leaves the file for the next replay, and the unique request_id turns its second insert into nothing:
rows count once whoever replays them (this process's retry thread, the next start-up, or another
process on the same directory).

Rows stay in memory only while the journal file cannot be written either (its disk is full too) or the
ledger has no data directory; the retry thread writes them out as soon as either side takes them.
(Past 400 lines: the file format, its locking and the retry state machine share one invariant, stated
on Journal, and read best together.)
"""

from __future__ import annotations

import datetime as dt
import errno
import json
import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from tokenfactory.meter.paths import PRIVATE_FILE_MODE, make_private_file
from tokenfactory.types import ParameterError

try:
    import fcntl
except ImportError:  # Windows: no flock; one process per data directory there
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)
FORMAT_VERSION = 1


@dataclass(frozen=True)
class LedgerConfig:
    busy_timeout_s: float = 5.0  # SQLite: how long a write waits for another writer's lock
    connect_timeout_s: float = 5.0  # server databases: how long a connection attempt may take
    retry_initial_s: float = 0.5  # first replay attempt after the database refused; doubles each failure
    retry_max_s: float = 10.0  # the longest wait between attempts (rows wait at most this after recovery)
    replay_batch_size: int = 1000

    def __post_init__(self) -> None:
        for name in ("busy_timeout_s", "connect_timeout_s", "retry_initial_s", "retry_max_s"):
            if not getattr(self, name) > 0:
                raise ParameterError(name, f"{name} must be > 0, got {getattr(self, name)}")
        if self.retry_max_s < self.retry_initial_s:
            raise ParameterError("retry_max_s", f"retry_max_s must be >= retry_initial_s ({self.retry_initial_s})")
        if self.replay_batch_size < 1:
            raise ParameterError("replay_batch_size", f"replay_batch_size must be >= 1, got {self.replay_batch_size}")


@dataclass(frozen=True)
class LedgerStatus:
    """What /health and /metrics show; read from memory, never from the database."""

    degraded: bool  # rows are waiting for the database (in the journal, or in memory)
    reason: str | None  # why, in words: never SQL text or its parameters
    num_pending: int  # rows not yet in the database, as this process knows them
    num_journalled_total: int  # rows sent to the journal since start-up (a slow write that committed late too)
    num_replayed_total: int  # journalled rows since found in the database (inserted, or already there)
    num_rejected_total: int  # lines the database cannot take (torn by a crash, invalid): kept in .rejected


class Replayed(NamedTuple):
    num_inserted: int
    rejected: list[dict[str, Any]]  # rows refused for what they hold (not for the database's state)


Insert = Callable[[list[dict[str, Any]]], Replayed]  # raises while the database refuses


# Why the database refused, in words, by what its driver said. Matched against the driver's own message
# (never shown: it may name a value), not SQLAlchemy's, which carries the SQL and its parameters.
FAILURE_WORDS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("readonly", "read-only", "read only"), "the database refuses writes (a read-only file or filesystem)"),
    (("disk is full", "no space left", "could not extend", "disk full"), "the disk holding the database is full"),
    (("database is locked", "database table is locked"),
     "another process holds the database's lock for longer than the busy timeout"),
    (("connection refused", "could not connect", "server closed the connection", "terminating connection",
      "the database system is", "connection is closed", "timeout expired", "consuming input failed",
      "connection to server", "connection failed"), "the database server cannot be reached (down or restarting)"),
    (("unable to open database",), "the database file cannot be opened"),
)


def driver_message(error: BaseException) -> str:
    """The driver's message (for logs), without SQLAlchemy's copy of the statement and parameters."""
    text = str(getattr(error, "orig", None) or error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def describe_failure(error: BaseException) -> str:
    """Why a write failed, in words fit for /health."""
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return "the disk holding the database is full"
    text = driver_message(error).lower()
    for needles, words in FAILURE_WORDS:
        if any(n in text for n in needles):
            return words
    if type(error).__name__ == "TimeoutError":  # SQLAlchemy's pool: every connection busy
        return "no database connection became free in time"
    return f"the database refused a write ({type(error).__name__})"


def encode(values: dict[str, Any]) -> str:
    """One journal line (ASCII: a lone surrogate in a tenant name is escaped, not an encoding error)."""
    return json.dumps({"v": FORMAT_VERSION, "row": values}, default=_json_default, separators=(",", ":"))


def decode(line: bytes) -> dict[str, Any]:
    obj = json.loads(line)
    if not isinstance(obj, dict) or obj.get("v") != FORMAT_VERSION or not isinstance(obj.get("row"), dict):
        raise ValueError("not a journal line of this version")
    row = obj["row"]
    row["created_at"] = dt.datetime.fromisoformat(row["created_at"])
    return row


def _json_default(value: object) -> str:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    raise TypeError(f"cannot journal a {type(value).__name__}")


class JournalFile:
    """The journal on disk: append (locked, fsynced), rotate aside for replay, read back, discard."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rejected_path = path.with_name(path.name + ".rejected")
        make_private_file(path, create=False)  # an existing one is tightened

    def append(self, rows: list[dict[str, Any]]) -> None:
        data = "".join(encode(r) + "\n" for r in rows).encode()
        fd = _open_locked(self.path)
        try:
            size = os.fstat(fd).st_size
            if size and _last_byte(fd, size) != b"\n":
                data = b"\n" + data  # a line torn by a killed writer stays a line of its own
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)  # releases the flock

    def rotate(self) -> None:
        """Move a non-empty journal aside for replay; appenders then start a new file."""
        if not self.path.exists():
            return
        fd = _open_locked(self.path)
        try:
            if os.fstat(fd).st_size:
                os.replace(self.path, self.path.with_name(f"{self.path.name}.replay-{uuid.uuid4().hex[:16]}"))
                _fsync_dir(self.path.parent)
        finally:
            os.close(fd)

    def pending_files(self) -> list[Path]:
        return sorted(self.path.parent.glob(self.path.name + ".replay-*"))

    def read(self, path: Path) -> tuple[list[dict[str, Any]], list[str]] | None:
        """The rows of a rotated file and its unreadable lines; None if another replayer removed it."""
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        rows, bad = [], []
        for line in raw.split(b"\n"):
            if not line.strip():
                continue
            try:
                rows.append(decode(line))
            except (ValueError, KeyError, TypeError):
                bad.append(line.decode("utf-8", "replace"))
        return rows, bad

    def discard(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        _fsync_dir(path.parent)

    def reject(self, lines: list[str]) -> None:
        """Keep what the database cannot take where an operator can read it."""
        fd = os.open(self.rejected_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE_FILE_MODE)
        try:
            _write_all(fd, "".join(line + "\n" for line in lines).encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def count(self) -> int:
        """Rows (non-empty lines) waiting in the journal and in files rotated for replay."""
        total = 0
        for path in [self.path, *self.pending_files()]:
            try:
                total += sum(1 for line in path.read_bytes().split(b"\n") if line.strip())
            except FileNotFoundError:
                pass
        return total

    def is_empty(self) -> bool:
        try:
            if self.path.stat().st_size:
                return False
        except FileNotFoundError:
            pass
        return not self.pending_files()


def _open_locked(path: Path) -> int:
    """An fd on `path` under an exclusive flock, checked to be the file the path names now: a replay
    may have renamed it between our open and our lock, and a row appended to the renamed file after
    it was read would be deleted with it."""
    while True:
        created = not path.exists()
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), PRIVATE_FILE_MODE)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            mine, now = os.fstat(fd), os.stat(path)
            if (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino):
                if created:
                    _fsync_dir(path.parent)  # the new file's name is durable too
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _last_byte(fd: int, size: int) -> bytes:
    os.lseek(fd, size - 1, os.SEEK_SET)
    return os.read(fd, 1)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _fsync_dir(path: Path) -> None:
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Journal:
    """Rows the database refused, until it takes them: held, written to the journal file, and replayed
    by a retry thread with backoff while degraded. Thread-safe. With `file` None (a ledger opened from a
    bare URL, without a data directory) rows are held in memory only, for as long as the process lives.

    Invariant: a journalled row is in `_held` or in the file (or both, briefly) until a replay has found
    it in the database; `_held` only grows at its end and only loses a prefix under `_flush_lock`."""

    def __init__(self, file: JournalFile | None, insert: Insert, config: LedgerConfig) -> None:
        self.file, self._insert, self.config = file, insert, config
        self._lock = threading.Lock()  # the state below
        self._flush_lock = threading.Lock()  # one writer of held rows at a time
        self._replay_lock = threading.Lock()  # one replay at a time in this process
        self._stop = threading.Event()
        self._held: list[dict[str, Any]] = []
        self._num_in_file = file.count() if file is not None else 0
        self._degraded, self._reason = False, None  # rows wait (shown by /health)
        self._refusing = False  # the database refused the last attempt: writers journal without trying it
        self._hold_noted = False
        self._num_journalled_total = self._num_replayed_total = self._num_rejected_total = 0
        self._retry: threading.Thread | None = None

    @property
    def refusing(self) -> bool:
        return self._refusing  # one attribute read: no lock needed

    def status(self) -> LedgerStatus:
        with self._lock:
            return LedgerStatus(self._degraded, self._reason, len(self._held) + self._num_in_file,
                                self._num_journalled_total, self._num_replayed_total, self._num_rejected_total)

    def journal(self, rows: list[dict[str, Any]], reason: str) -> None:
        """Keep `rows` until the database takes them: durable on return unless the journal file refuses
        too (then held in memory, and retried)."""
        with self._lock:
            self._held.extend(rows)
            self._num_journalled_total += len(rows)
        self.degrade(reason)
        self._flush_held()

    def degrade(self, reason: str) -> None:
        """Say why rows wait, and make sure a retry thread is working on them."""
        with self._lock:
            if not self._degraded:
                where = self.file.path if self.file is not None else "memory (no data directory)"
                logger.warning("ledger degraded: %s; rows wait in %s until the database takes them", reason, where)
            self._degraded, self._refusing, self._reason = True, True, reason
            if self._retry is None and not self._stop.is_set():
                self._retry = threading.Thread(target=self._retry_loop, name="ledger-retry", daemon=True)
                self._retry.start()

    def replay(self) -> int:
        """Put every waiting row into the database; returns the rows taken. Raises what the database
        raised if it still refuses: the rows stay where they were."""
        with self._replay_lock:
            return self._replay_locked()

    def _replay_locked(self) -> int:
        num = 0
        if not self._flush_held():  # the journal refuses too: held rows go straight to the database
            num += self._replay_held()
        if self.file is not None:
            self.file.rotate()
            for path in self.file.pending_files():
                num += self._replay_file(path)
        return num

    def _flush_held(self) -> bool:
        """Held rows to the journal file; True when none remain held."""
        with self._flush_lock:
            with self._lock:
                rows = list(self._held)
            if not rows:
                return True
            if self.file is None:
                return False
            try:
                self.file.append(rows)
            except OSError as e:
                self._note_held(e)
                return False
            with self._lock:
                del self._held[:len(rows)]
                self._num_in_file += len(rows)
                return not self._held

    def _note_held(self, error: OSError) -> None:
        with self._lock:
            if not self._hold_noted:
                logger.error("ledger: the journal %s cannot be written either (%s); rows are held in memory",
                             self.file.path if self.file else None, error.strerror or error)
                self._reason = f"{self._reason or 'the database refuses writes'}; the journal cannot be " \
                               "written either, rows are held in memory"
            self._hold_noted = True

    def _replay_held(self) -> int:
        with self._flush_lock:
            with self._lock:
                rows = list(self._held)
            rejected = self._insert_batches(rows)
            with self._lock:
                del self._held[:len(rows)]
                self._num_replayed_total += len(rows) - len(rejected)
                self._num_rejected_total += len(rejected)
        if rejected and self.file is not None:
            self.file.reject([encode(r) for r in rejected])
        return len(rows)

    def _replay_file(self, path: Path) -> int:
        assert self.file is not None
        read = self.file.read(path)
        if read is None:  # another process replayed it meanwhile
            return 0
        rows, bad = read
        if bad:
            logger.warning("ledger: skipped %d unreadable line(s) in %s (a write cut short by a crash); "
                           "kept in %s", len(bad), path.name, self.file.rejected_path)
        rejected = self._insert_batches(rows)
        if bad or rejected:
            self.file.reject(bad + [encode(r) for r in rejected])
        self.file.discard(path)
        with self._lock:
            self._num_replayed_total += len(rows) - len(rejected)
            self._num_rejected_total += len(bad) + len(rejected)
            self._num_in_file = max(0, self._num_in_file - len(rows) - len(bad))
        return len(rows)

    def _insert_batches(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        rejected: list[dict[str, Any]] = []
        size = self.config.replay_batch_size
        for start in range(0, len(rows), size):
            rejected += self._insert(rows[start:start + size]).rejected
        if rejected:
            logger.error("ledger: %d journalled row(s) refused by the database for their content; kept in %s",
                         len(rejected), self.file.rejected_path if self.file else "the log")
        return rejected

    def _retry_loop(self) -> None:
        delay = self.config.retry_initial_s
        while not self._stop.wait(delay):
            try:
                self.replay()
            except Exception as e:  # noqa: BLE001 - the database still refuses: try again later
                logger.debug("ledger: replay failed (%s); next try in %.1f s", type(e).__name__, delay)
                delay = min(delay * 2, self.config.retry_max_s)
                continue
            # The database took the replay: writers go back to it, so that under load the journal drains
            # instead of refilling as fast as it is replayed.
            self._refusing = False
            if self._recovered():
                return
            delay = self.config.retry_initial_s

    def _recovered(self) -> bool:
        """Leave the degraded state if nothing waits any more (checked under the lock that journal()
        takes, so a row journalled meanwhile either shows here or starts a new retry thread)."""
        with self._lock:
            if self._held or (self.file is not None and not self.file.is_empty()):
                return False
            self._degraded, self._refusing, self._reason, self._retry = False, False, None, None
            self._hold_noted = False
            self._num_in_file = 0
            replayed = self._num_replayed_total
        logger.info("ledger recovered: every journalled row is in the database (%d replayed since start-up)",
                    replayed)
        return True

    def close(self, timeout_s: float) -> None:
        """Stop retrying, try one last replay, write what is still held to the journal file. Whatever
        the database did not take stays in the journal for the next start."""
        self._stop.set()
        with self._lock:
            retry = self._retry
        if retry is not None:
            retry.join(timeout_s)
        if self._degraded and self._replay_lock.acquire(timeout=timeout_s):
            try:
                self._replay_locked()
                self._recovered()
            except Exception as e:  # noqa: BLE001 - the next start replays them
                logger.warning("ledger: rows stay in the journal for the next start (%s)", type(e).__name__)
            finally:
                self._replay_lock.release()
        self._flush_held()
        with self._lock:
            num_held = len(self._held)
        if num_held:
            logger.error("ledger: %d row(s) could not be written to the database or the journal and are lost "
                         "at exit", num_held)
