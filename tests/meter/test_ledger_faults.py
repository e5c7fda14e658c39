"""A ledger that never drops a row (issue #13), on real SQLite files: the database refuses writes (a
read-only file, an immutable file, a full filesystem, a lock held by another process), rows go to the
journal and come back exactly once; replays race, a writer is SIGKILLed mid-journal, a line is torn.
After each fault every acknowledged row is in the ledger once and the daily sums agree with the rows."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa

from tokenfactory.meter.journal import JournalFile, encode
from tokenfactory.meter.ledger import Ledger, LedgerConfig, LedgerRow, row_values
from tokenfactory.meter.paths import journal_path, ledger_path
from tokenfactory.meter.schema import requests_table

# Short waits so a fault shows in milliseconds, not the production seconds.
FAST = LedgerConfig(busy_timeout_s=0.1, retry_initial_s=0.05, retry_max_s=0.2)


def row(i: int, **kw: object) -> LedgerRow:
    base: dict = dict(model="m", status="finished", prompt_tokens=10, completion_tokens=i, tenant=f"t{i % 3}",
                      energy_joules=0.5 * i, energy_source="modelled", cost_usd=0.001 * i)
    base.update(kw)
    return LedgerRow(f"r{i}", **base)


def assert_each_once(ledger: Ledger, ids: Iterator[str] | list[str]) -> None:
    """No row lost, none doubled, and the daily sums (what usage and budgets read) equal the rows."""
    ids = set(ids)
    t = requests_table.c
    with ledger.engine.connect() as conn:
        counts = dict(conn.execute(sa.select(t.request_id, sa.func.count()).group_by(t.request_id)).all())
    assert not ids - set(counts), f"lost: {sorted(ids - set(counts))[:5]}"
    assert not set(counts) - ids, f"unexpected: {sorted(set(counts) - ids)[:5]}"
    assert max(counts.values(), default=1) == 1, f"doubled: {[k for k, v in counts.items() if v > 1][:5]}"
    [fast], [raw] = ledger.totals(), ledger.raw_totals()
    assert (fast.num_requests, fast.completion_tokens) == (raw.num_requests, raw.completion_tokens) == \
        (len(ids), raw.completion_tokens)
    assert fast.energy_joules == pytest.approx(raw.energy_joules)


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """For the retry thread, which works on the real clock (its backoff is FAST's 50-200 ms)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_request_id_is_recorded_once(tmp_path: Path) -> None:
    ledger = Ledger.open(tmp_path)
    ledger.record(row(1))
    ledger.record(row(1, completion_tokens=99))  # a second settle, a replay, a race: nothing added
    assert ledger.record_many([row(1), row(2), row(2, completion_tokens=7), row(3)]) == 2
    assert_each_once(ledger, ["r1", "r2", "r3"])
    assert ledger.find("r1")[0].completion_tokens == 1 and ledger.find("r2")[0].completion_tokens == 2
    ledger.close()


def test_an_old_ledger_gets_the_unique_index_or_keeps_working_without(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    def make_old(directory: Path, duplicate: bool) -> None:  # as ledgers were before request_id was unique
        ledger = Ledger.open(directory)
        with ledger.engine.begin() as conn:
            conn.exec_driver_sql("DROP INDEX ux_requests_request_id")
            conn.exec_driver_sql("CREATE INDEX ix_requests_request_id ON requests (request_id)")
            conn.execute(requests_table.insert(), [row_values(row(1))] * (2 if duplicate else 1))
        ledger.close()

    make_old(tmp_path / "clean", duplicate=False)
    ledger = Ledger.open(tmp_path / "clean")
    assert any(i["unique"] for i in sa.inspect(ledger.engine).get_indexes("requests"))
    ledger.record(row(1))
    assert ledger.count() == 1
    ledger.close()

    make_old(tmp_path / "dups", duplicate=True)
    with caplog.at_level(logging.WARNING):
        ledger = Ledger.open(tmp_path / "dups")
    assert caplog.text.count("cannot be made unique") == 1
    ledger.record(row(1))  # looked up first: not a third copy
    ledger.record(row(2))
    assert ledger.count() == 3 and len(ledger.find("r2")) == 1
    ledger.close()


def test_a_read_only_database_journals_and_the_next_open_replays(tmp_path: Path) -> None:
    Ledger.open(tmp_path).close()
    read_only = Ledger(f"sqlite:///file:{ledger_path(tmp_path)}?mode=ro&uri=true",
                       journal_path=journal_path(tmp_path), config=FAST)
    for i in range(20):
        read_only.record(row(i))  # never raises
    s = read_only.status()
    assert s.degraded and s.num_pending == 20 and s.num_journalled_total == 20
    assert s.reason == "the database refuses writes (a read-only file or filesystem)"  # words, no SQL
    files = list(tmp_path.glob("ledger-journal*"))  # the journal, or its copy a retry moved aside
    assert files and all(mode(f) == 0o600 for f in files)
    read_only.close()  # its last replay fails too: the rows stay for the next start
    ledger = Ledger.open(tmp_path)
    assert_each_once(ledger, [f"r{i}" for i in range(20)])
    assert not ledger.status().degraded and JournalFile(journal_path(tmp_path)).is_empty()
    ledger.close()


@contextmanager
def immutable(path: Path) -> Iterator[Callable[[], None]]:
    """chattr +i: even root cannot write the file (chmod does not stop root)."""
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported here (needs root and ext4/xfs/tmpfs)")

    def release() -> None:
        subprocess.run(["chattr", "-i", str(path)], check=True)

    try:
        yield release
    finally:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)


def test_a_file_made_read_only_then_writable_recovers_in_place(tmp_path: Path) -> None:
    Ledger.open(tmp_path).close()
    with immutable(ledger_path(tmp_path)) as make_writable:
        ledger = Ledger.open(tmp_path, config=FAST)
        for i in range(30):
            ledger.record(row(i))
        assert ledger.status().degraded and ledger.status().num_pending == 30
        make_writable()
        wait_until(lambda: not ledger.status().degraded)  # the retry thread, no restart
    s = ledger.status()
    assert (s.num_pending, s.num_replayed_total) == (0, 30)
    assert_each_once(ledger, [f"r{i}" for i in range(30)])
    ledger.close()


class FullDisk:
    """A real tiny tmpfs filled with a file (as root); where mounting is not permitted, the database write
    and the journal append raise ENOSPC (monkeypatched) instead, and the test runs the same."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dir, self.monkeypatch, self.filler = tmp_path / "disk", monkeypatch, None
        self.dir.mkdir()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k,mode=0700", "tmpfs", str(self.dir)],
                                 capture_output=True)
        self.real = mounted.returncode == 0

    def fill(self) -> None:
        if not self.real:
            def refuse(*_: object) -> None:
                raise sa.exc.OperationalError("INSERT", {}, sqlite3.OperationalError("database or disk is full"))

            def no_space(*_: object) -> None:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.monkeypatch.setattr(Ledger, "_insert_new", refuse)
            self.monkeypatch.setattr(JournalFile, "append", no_space)
            return
        self.filler = self.dir / "filler"
        with open(self.filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC

    def free(self) -> None:
        if self.real:
            self.filler.unlink()
        else:
            self.monkeypatch.undo()

    def remove(self) -> None:
        if self.real:
            subprocess.run(["umount", "-l", str(self.dir)], check=True)


def test_a_full_disk_loses_no_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = FullDisk(tmp_path, monkeypatch)
    try:
        ledger = Ledger.open(disk.dir, config=FAST)
        ledger.record(row(0))
        disk.fill()
        num_rows = 1
        while not ledger.status().degraded and num_rows < 3000:  # SQLite reuses its WAL's free pages first
            ledger.record(row(num_rows, model="m" * 200))
            num_rows += 1
        for _ in range(20):
            ledger.record(row(num_rows))
            num_rows += 1
        s = ledger.status()
        assert s.degraded and s.reason.startswith("the disk holding the database is full")
        assert "held in memory" in s.reason  # the journal is on the same full disk
        disk.free()
        wait_until(lambda: not ledger.status().degraded)
        assert_each_once(ledger, [f"r{i}" for i in range(num_rows)])
        ledger.close()
    finally:
        disk.remove()


LOCKER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.readline()
conn.execute("COMMIT")
"""


@contextmanager
def lock_held(path: Path) -> Iterator[Callable[[], None]]:
    """Another process holding the database's write lock (BEGIN EXCLUSIVE) until released."""
    proc = subprocess.Popen([sys.executable, "-c", LOCKER, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"

    def release() -> None:
        proc.stdin.close()
        assert proc.wait(10) == 0

    try:
        yield release
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_lock_held_by_another_process(tmp_path: Path) -> None:
    ledger = Ledger.open(tmp_path, config=FAST)
    ledger.record(row(0))
    with lock_held(ledger_path(tmp_path)) as release:
        started = time.monotonic()
        writers = [threading.Thread(target=lambda k=k: [ledger.record(row(i)) for i in range(1 + k, 41, 4)])
                   for k in range(4)]
        for w in writers:
            w.start()
        for w in writers:
            w.join()
        assert time.monotonic() - started < 5  # each write gave up after the busy timeout, then journalled
        s = ledger.status()
        assert s.degraded and "lock" in s.reason and s.num_pending == 40
        assert ledger.count() == 1  # readers go on (WAL)
        release()
    wait_until(lambda: not ledger.status().degraded)
    assert_each_once(ledger, [f"r{i}" for i in range(41)])
    assert ledger.status().num_replayed_total == 40
    ledger.close()


REPLAYER = """
import sys
from tokenfactory.meter.ledger import Ledger
Ledger.open(sys.argv[1]).close()  # replays at open
"""


def test_concurrent_replays_count_each_row_once(tmp_path: Path) -> None:
    Ledger.open(tmp_path).close()
    journal = JournalFile(journal_path(tmp_path))
    journal.append([row_values(row(i)) for i in range(300)])
    # A replay killed after its insert, before it deleted its file, left the same rows behind once more.
    shutil.copy(journal.path, journal.path.with_name(journal.path.name + ".replay-crashed"))
    proc = subprocess.Popen([sys.executable, "-c", REPLAYER, str(tmp_path)])
    opened: list[Ledger] = []
    threads = [threading.Thread(target=lambda: opened.append(Ledger.open(tmp_path))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert proc.wait(60) == 0
    ledger = Ledger.open(tmp_path)
    assert_each_once(ledger, [f"r{i}" for i in range(300)])
    assert journal.is_empty() and not journal.rejected_path.exists()
    for other in [*opened, ledger]:
        other.close()


def test_a_torn_last_line_is_skipped_and_the_rest_replayed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    Ledger.open(tmp_path).close()
    journal = JournalFile(journal_path(tmp_path))
    journal.append([row_values(row(i)) for i in range(5)])
    with open(journal.path, "ab") as f:  # a writer killed mid-line: no newline, half a row
        f.write(encode(row_values(row(5)))[:40].encode())
    journal.append([row_values(row(6))])  # the next append starts a line of its own
    with caplog.at_level(logging.WARNING):
        ledger = Ledger.open(tmp_path)
    assert "1 unreadable line(s)" in caplog.text
    assert_each_once(ledger, ["r0", "r1", "r2", "r3", "r4", "r6"])
    assert ledger.status().num_rejected_total == 1
    assert journal.rejected_path.read_text().startswith('{"v":1,"row":{"request_id":"r5"')
    ledger.close()


KILLED_WRITER = """
import sys
from pathlib import Path
from tokenfactory.meter.ledger import Ledger, LedgerRow
from tokenfactory.meter.paths import journal_path, ledger_path
data = Path(sys.argv[1])
ledger = Ledger(f"sqlite:///file:{ledger_path(data)}?mode=ro&uri=true", journal_path=journal_path(data))
for i in range(1_000_000):
    ledger.record(LedgerRow(f"k{i}", "m", "finished", 1, i))
    print(f"k{i}", flush=True)  # acknowledged: record() returned, so the row must survive
"""


def test_sigkill_while_journalling_loses_no_acknowledged_row(tmp_path: Path) -> None:
    Ledger.open(tmp_path).close()
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    acknowledged = [proc.stdout.readline().strip() for _ in range(150)]
    proc.send_signal(signal.SIGKILL)
    acknowledged += [line.strip() for line in proc.stdout if line.strip()]
    assert proc.wait(10) == -signal.SIGKILL
    ledger = Ledger.open(tmp_path)
    ids = {r for (r,) in ledger.engine.connect().execute(sa.select(requests_table.c.request_id))}
    assert set(acknowledged) <= ids and len(ids) <= len(acknowledged) + 1  # + the one in flight, if whole
    assert_each_once(ledger, ids)
    ledger.close()


def test_the_data_directory_and_its_files_are_private(tmp_path: Path) -> None:
    data = tmp_path / "data"
    ledger = Ledger.open(data)
    ledger.record(row(1))
    assert mode(data) == 0o700 and mode(data / "ledger.db") == 0o600
    assert mode(data / "ledger.db-wal") == 0o600 and mode(data / "ledger.db-shm") == 0o600
    ledger.journal(row(2), "a test")
    files = list(data.glob("ledger-journal*"))  # the journal, or its copy a retry moved aside
    assert files and all(mode(f) == 0o600 for f in files)
    ledger.close()
    os.chmod(data, 0o755)  # as an earlier version (or a careless copy) left them
    os.chmod(data / "ledger.db", 0o644)
    journal_path(data).write_text("")
    os.chmod(journal_path(data), 0o644)
    Ledger.open(data).close()
    assert (mode(data), mode(data / "ledger.db"), mode(journal_path(data))) == (0o700, 0o600, 0o600)


def test_without_a_data_directory_rows_wait_in_memory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    Ledger.open(tmp_path).close()
    read_only = Ledger(f"sqlite:///file:{ledger_path(tmp_path)}?mode=ro&uri=true", config=FAST)
    read_only.record(row(1))  # a bare URL has no journal file: held, and said so at exit
    assert read_only.status().num_pending == 1 and read_only.journal_path is None
    with caplog.at_level(logging.ERROR):
        read_only.close()
    assert "1 row(s) could not be written" in caplog.text
