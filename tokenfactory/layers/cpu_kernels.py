"""Hand-written CPU kernels, compiled on first use with the machine's C++ compiler, and a fallback.

Only what PyTorch has no op for, or no fast one, lives here (`csrc/cpu_kernels.cpp`): decode attention
straight from the paged KV cache (in the model's dtype or int8 with scales; full or sliding-window), and
RMSNorm (PyTorch's spends ~18 us per 576-wide row in separate kernels, a tenth of a single-stream int4
decode step over 61 norms), and int4 weights dequantized straight from torch's packed layout (so on-the-fly
quantized layers keep their codes once; PyTorch ops took ~3x as long). The build goes to a per-machine cache
(`~/.cache/tokenfactory/kernels`, or `$TOKENFACTORY_KERNEL_CACHE`), keyed by the source, the compiler flags,
the CPU and the torch version, so a process compiles once (~20 s on 2 cores) and every later process loads
it in milliseconds. Loading a `.so` runs its code, so the cache is used only when it, the build's directory
and every file in it belong to this user and no one else can write them (it is created 0700); otherwise
the kernels are built in a fresh private directory for this process, with one warning saying why. If the
build fails (no compiler, no Python headers), the engine says so once and uses its PyTorch path; setting
`TOKENFACTORY_CPU_KERNELS=0` asks for the PyTorch path outright.

torch's `load` guards a build with a `lock` file it creates and removes; a build killed midway leaves that file
behind, and every later `load` of the directory then waits for it forever (a server that never starts). So each
build also holds our own `flock` on `build.flock` beside it, which the kernel drops when the process dies: under
that lock a `lock` file is a dead build's, and is removed before `load` runs.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# The kernels (ATen only) and their bindings (torch/python.h) are two translation units, which ninja compiles
# in parallel: a first build took 41 s as one file on 2 cores, ~21 s split (csrc/cpu_kernels.h).
SOURCES = (CSRC / "cpu_kernels.cpp", CSRC / "bindings.cpp")
HEADERS = (CSRC / "cpu_kernels.h",)
# -fopenmp: at::parallel_for, on torch's own libgomp (already loaded, so reused: one thread pool);
# -ffast-math: lets g++ vectorize the softmax's expf (glibc's libmvec), a 1.5-2x on the whole kernel.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
_lock = threading.Lock()
_module: Any = None
_tried = False


def _cpu_model() -> str:
    """The CPU's name and instruction-set flags (a build with -march=native is only good for those)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    name = next((line for line in lines if line.startswith("model name")), "")
    flags = next((line for line in lines if line.startswith("flags")), "")
    return f"{name}\n{flags}"


def cache_root() -> Path:
    return Path(os.environ.get("TOKENFACTORY_KERNEL_CACHE") or Path.home() / ".cache" / "tokenfactory" / "kernels")


def untrusted_reason(path: Path) -> str | None:
    """Why code under `path` may be another user's, or None when only this user can have written it."""
    st = path.stat()  # followed: a symlinked cache is judged by what it points to
    if st.st_uid != os.geteuid():
        return f"{path} is owned by uid {st.st_uid}, not this user ({os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by its group or others (mode {stat.filemode(st.st_mode)})"
    return None


def _cache_problem(root: Path, path: Path) -> str | None:
    """The first reason not to load from the cache's build directory `path`, or None."""
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)  # parents get the umask; the cache itself is private
        path.mkdir(exist_ok=True, mode=0o700)
        return next(filter(None, map(untrusted_reason, [root, path, *sorted(path.iterdir())])), None)
    except OSError as e:
        return f"{root} is not usable ({e})"


@functools.cache
def source_digest() -> str:
    """The kernels' sources and flags, hashed: what a build is of (the machine profile, which times these kernels,
    keys on it too, so that a changed kernel is timed again)."""
    texts = [path.read_text() for path in (*SOURCES, *HEADERS)]
    return hashlib.sha256("\n".join([*texts, " ".join(CFLAGS)]).encode()).hexdigest()[:16]


def _build_dir() -> Path:
    """The cache's directory for this build, or a fresh private one when the cache is not safe to load from."""
    key = hashlib.sha256("\n".join([source_digest(), _cpu_model(), torch.__version__,
                                    platform.python_version()]).encode()).hexdigest()[:16]
    root = cache_root()
    problem = _cache_problem(root, root / key)
    if problem is None:
        return root / key
    private = Path(tempfile.mkdtemp(prefix="tokenfactory-kernels-"))  # 0700, this user's
    atexit.register(shutil.rmtree, private, ignore_errors=True)
    logger.warning("not loading CPU kernels from the cache: %s; building them in %s for this process instead "
                   "(fix the cache, e.g. `chmod -R go-w` it or remove it, or set TOKENFACTORY_KERNEL_CACHE)",
                   problem, private)
    return private


def _make_private(path: Path) -> None:
    """Drop group/other write bits from a finished build (a umask of 002 gives 0775 files, refused next time)."""
    for entry in path.iterdir():
        st = entry.lstat()
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o022:
            entry.chmod(stat.S_IMODE(st.st_mode) & ~0o022)


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Hold this build directory's flock (waiting for a live build of another process to finish), and remove the
    `lock` file a killed build left: while we hold the flock, no live build of ours can own it."""
    fd = os.open(build_dir / "build.flock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a kernel build that was killed before it finished", stale)
            stale.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the flock


def _load() -> Any:
    """The compiled module, or None where it cannot be built (said once, in a warning)."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        if os.environ.get("TOKENFACTORY_CPU_KERNELS", "1") == "0":
            logger.info("CPU kernels off (TOKENFACTORY_CPU_KERNELS=0): decode attention and norms use PyTorch ops")
        else:
            try:
                from torch.utils.cpp_extension import load

                if shutil.which("ninja") is None:  # the `ninja` package's binary, in a venv not on PATH
                    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
                build_dir = _build_dir()
                with build_lock(build_dir):
                    _module = load(name="tokenfactory_cpu_kernels", sources=[str(path) for path in SOURCES],
                                   extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                                   build_directory=str(build_dir), verbose=False)
                    _make_private(build_dir)
            except Exception as e:  # noqa: BLE001 - any build failure means: use the fallback
                logger.warning("could not build the CPU kernels (%s: %s); using the PyTorch path, which copies "
                               "each sequence's KV blocks every step", type(e).__name__,
                               (str(e).strip().splitlines() or [""])[-1])
        _tried = True
        return _module


def paged_decode_kernel() -> Callable[..., torch.Tensor] | None:
    """`f(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale, window=0) -> out`, or None."""
    module = _load()
    return None if module is None else module.paged_decode_attention


def paged_decode_kernel_int8() -> Callable[..., torch.Tensor] | None:
    """`f(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start, scale, window=0) -> out`
    over int8 caches with float16 scales (kv_quant.py), or None."""
    module = _load()
    return None if module is None else module.paged_decode_attention_int8


def rms_norm_kernel() -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None:
    """`f(x (T, H) contiguous, weight (H,), eps) -> out`, or None."""
    module = _load()
    return None if module is None else module.rms_norm


def fused_kernels() -> Any:
    """The module with the decoder layer's fused small ops (add_rms_norm, silu_mul, rope_write_kv,
    rope_decode_attention), or None."""
    return _load()


def int4pack_dequantize_kernel() -> Callable[..., torch.Tensor] | None:
    """`f(packed (N, K/2) uint8, scales_and_zeros (K/g, N, 2) bf16, group, block_n, full_halves) -> W^T (K, N)`
    bf16 from torch's CPU int4 pack (layout in csrc/cpu_kernels.cpp), or None."""
    module = _load()
    return None if module is None else module.int4pack_dequantize_t


def q8act_kernel() -> Callable[..., torch.Tensor] | None:
    """`f(x (M, K), codes, scales, mins, q4) -> (M, N)`: quantized weights against int8-quantized activations
    (csrc/cpu_kernels.cpp q8act_linear), or None where its AVX-512 VNNI fast path was not compiled."""
    module = _load()
    return module.q8act_linear if module is not None and module.q8act_fast_path() else None
