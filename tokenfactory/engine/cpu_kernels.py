"""Hand-written CPU kernels, compiled on first use with the machine's C++ compiler, and a fallback.

Only what PyTorch has no op for, or no fast one, lives here (`csrc/cpu_kernels.cpp`): decode attention
straight from the paged KV cache, and RMSNorm (PyTorch's spends ~18 us per 576-wide row in separate
kernels, a tenth of a single-stream int4 decode step over 61 norms). The build goes to a per-machine cache
(`~/.cache/tokenfactory/kernels`, or `$TOKENFACTORY_KERNEL_CACHE`), keyed by the source, the compiler flags,
the CPU and the torch version, so a process compiles once (~20 s on 2 cores) and every later process loads
it in milliseconds. If the
build fails (no compiler, no Python headers), the engine says so once and uses its PyTorch path; setting
`TOKENFACTORY_CPU_KERNELS=0` asks for the PyTorch path outright.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
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


def _build_dir() -> Path:
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(CFLAGS), _cpu_model(), torch.__version__,
                                    platform.python_version()]).encode()).hexdigest()[:16]
    root = os.environ.get("TOKENFACTORY_KERNEL_CACHE") or Path.home() / ".cache" / "tokenfactory" / "kernels"
    path = Path(root) / key
    path.mkdir(parents=True, exist_ok=True)
    return path


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
                _module = load(name="tokenfactory_cpu_kernels", sources=[str(SOURCE)], extra_cflags=CFLAGS,
                               extra_ldflags=["-fopenmp"], build_directory=str(_build_dir()), verbose=False)
            except Exception as e:  # noqa: BLE001 - any build failure means: use the fallback
                logger.warning("could not build the CPU kernels (%s: %s); using the PyTorch path, which copies "
                               "each sequence's KV blocks every step", type(e).__name__,
                               (str(e).strip().splitlines() or [""])[-1])
        _tried = True
        return _module


def paged_decode_kernel() -> Callable[..., torch.Tensor] | None:
    """`f(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale) -> out`, or None."""
    module = _load()
    return None if module is None else module.paged_decode_attention


def rms_norm_kernel() -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None:
    """`f(x (T, H) contiguous, weight (H,), eps) -> out`, or None."""
    module = _load()
    return None if module is None else module.rms_norm
