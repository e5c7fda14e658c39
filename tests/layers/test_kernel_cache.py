"""The CPU kernel cache is loaded from only when this user alone can have written it (issue #13).

Loading a `.so` runs its code: a cache directory another user owns or can write is a way to run code as
whoever starts the server. These tests make such directories for real (chmod 0777, chown to nobody) and
check that the build goes to a fresh private directory instead, with a warning saying why.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest
import torch.utils.cpp_extension

from tokenfactory.layers import cpu_kernels

NOBODY = 65534


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache" / "kernels"
    monkeypatch.setenv("TOKENFACTORY_KERNEL_CACHE", str(path))
    return path


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def assert_private_elsewhere(build_dir: Path, root: Path) -> None:
    assert root not in build_dir.parents
    assert build_dir.stat().st_uid == os.geteuid() and mode(build_dir) == 0o700
    assert list(build_dir.iterdir()) == []  # fresh: nothing planted in it


def test_a_new_cache_is_created_private_and_used(root: Path) -> None:
    build_dir = cpu_kernels._build_dir()
    assert build_dir.parent == root
    assert mode(root) == 0o700 and mode(build_dir) == 0o700
    assert cpu_kernels._build_dir() == build_dir  # and used again by the next process


def test_an_existing_0755_cache_of_ours_is_still_used(root: Path) -> None:
    root.mkdir(parents=True, mode=0o755)
    root.chmod(0o755)  # what the old code left behind: not writable by others, so safe
    assert cpu_kernels._build_dir().parent == root


def test_a_world_writable_cache_is_refused(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    build_dir = cpu_kernels._build_dir()
    root.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        refused = cpu_kernels._build_dir()
    assert_private_elsewhere(refused, root)
    assert refused != build_dir
    assert f"{root} is writable by its group or others" in caplog.text and str(refused) in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_cache_owned_by_another_user_is_refused(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    root.mkdir(parents=True, mode=0o755)
    os.chown(root, NOBODY, NOBODY)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        refused = cpu_kernels._build_dir()
    assert_private_elsewhere(refused, root)
    assert f"{root} is owned by uid {NOBODY}" in caplog.text


def test_a_planted_or_writable_file_in_the_build_dir_is_refused(root: Path) -> None:
    build_dir = cpu_kernels._build_dir()
    planted = build_dir / "tokenfactory_cpu_kernels.so"
    planted.write_bytes(b"not ours")
    planted.chmod(0o666)
    assert_private_elsewhere(cpu_kernels._build_dir(), root)
    planted.chmod(0o644)
    assert cpu_kernels._build_dir() == build_dir
    if os.geteuid() == 0:
        os.chown(planted, NOBODY, NOBODY)
        assert "is owned by uid" in (cpu_kernels._cache_problem(root, build_dir) or "")


def test_a_cache_that_cannot_be_created_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache's parent should be")
    monkeypatch.setenv("TOKENFACTORY_KERNEL_CACHE", str(blocker / "kernels"))
    assert_private_elsewhere(cpu_kernels._build_dir(), blocker)


def test_load_builds_in_the_private_dir_and_tightens_the_build(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The seam is torch's `load`: record where it is asked to build (no compiler run here)."""
    root.mkdir(parents=True)
    root.chmod(0o777)
    asked: list[Path] = []

    def fake_load(**kwargs: object) -> object:
        build_dir = Path(str(kwargs["build_directory"]))
        asked.append(build_dir)
        (build_dir / "tokenfactory_cpu_kernels.so").write_bytes(b"built")
        (build_dir / "tokenfactory_cpu_kernels.so").chmod(0o775)  # as a umask of 002 leaves it
        return object()

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_module", None)
    monkeypatch.setenv("TOKENFACTORY_CPU_KERNELS", "1")
    assert cpu_kernels._load() is not None
    assert len(asked) == 1 and root not in asked[0].parents
    assert mode(asked[0] / "tokenfactory_cpu_kernels.so") == 0o755


def loader_that_records_the_lock(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """torch's `load` replaced by one that records whether its own `lock` file was there when it was called."""
    lock_seen: list[bool] = []

    def fake_load(**kwargs: object) -> object:
        lock_seen.append((Path(str(kwargs["build_directory"])) / "lock").exists())
        return object()

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_module", None)
    monkeypatch.setenv("TOKENFACTORY_CPU_KERNELS", "1")
    return lock_seen


def test_a_killed_builds_lock_file_is_removed(root: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """A build killed midway leaves torch's `lock` file; torch's `load` would wait for it forever."""
    build_dir = cpu_kernels._build_dir()
    (build_dir / "lock").touch(mode=0o600)
    lock_seen = loader_that_records_the_lock(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels._load() is not None
    assert lock_seen == [False]
    assert "left by a kernel build that was killed" in caplog.text


def test_a_live_build_is_waited_for_not_broken(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While another build holds the flock, its `lock` file is its own: left alone until that build ends."""
    import fcntl
    import threading

    build_dir = cpu_kernels._build_dir()
    lock_seen = loader_that_records_the_lock(monkeypatch)
    holder = os.open(build_dir / "build.flock", os.O_RDWR | os.O_CREAT, 0o600)  # another build's open file
    fcntl.flock(holder, fcntl.LOCK_EX)
    (build_dir / "lock").touch(mode=0o600)
    loading = threading.Thread(target=cpu_kernels._load)
    loading.start()
    loading.join(timeout=0.5)
    assert loading.is_alive() and (build_dir / "lock").exists() and lock_seen == []
    (build_dir / "lock").unlink()  # the live build finishes: torch removes its lock, then the flock goes
    os.close(holder)
    loading.join(timeout=30)
    assert not loading.is_alive() and lock_seen == [False]
