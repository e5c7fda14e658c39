"""The bytes a quantized linear layer keeps, from its shape alone, without torch: the one accounting behind
engine/placement.py's `planned_weight_bytes` (the start-up check, held equal to the placed model's bytes by
tests/models/test_streaming_quant.py) and the planner's engine figures (`tokenfactory plan`, which imports no torch).

    packed   the kernel's own buffers (layers/quant.py KERNELS), what a decode step reads
    copy     + the dequantized weight in the model's dtype, for large steps
    prepacked  + that copy twice: plain, and in oneDNN's layout for steps of up to 256 rows (CPU, bfloat16)
    on-the-fly, from the packed buffer (CPU packed kernels)    + nothing
    on-the-fly, codes apart (CUDA, int8 per channel, no kernel)   + the codes and scales in the model's dtype
    act-order (a checkpoint's g_idx)                              + the input order, int64 per input

`kernel_for` restates KERNELS' shape rules (tests/models/test_streaming_quant.py checks it against `pick_kernel`);
the engine itself asks `pick_kernel`, which also knows whether this torch has the CUDA kernel.
"""

from __future__ import annotations

import functools

INT4_KERNEL_GROUPS = (32, 64, 128, 256)
# On-the-fly dequantizes these kernels' own buffers: torch's CPU pack's when its layout is recognised
# (layers/quant.py int4pack_layout; every layout of torch 2.13's is), the int8-activation kernels' always.
READS_PACKED = ("cpu-int4pack", "cpu-int8-as-int4-planes", "cpu-int5-as-int4-planes", "cpu-uint8-as-int4-planes",
                "cpu-int4-q8act", "cpu-int8-q8act")
INPUT_ORDER_BYTES = 8  # QuantizedLinear.input_order: int64 per input
DENSE_COPIES = {"prepacked": 2, "copy": 1}  # dense paths that keep the dequantized weight, and how many times


def dense_order(device_type: str) -> tuple[str, ...]:
    """The dense paths `--quantization-dense auto` tries, fastest first, keeping the first whose weights fit (serve's
    start-up check and `tokenfactory plan --engine tokenfactory` both ask this): oneDNN's prepacked copy beside the
    plain one on a CPU, the plain copy, the codes alone. On CUDA `auto_dense` also weighs the copy against bf16."""
    return ("prepacked", "copy", "on-the-fly") if device_type == "cpu" else ("copy", "on-the-fly")


Q8ACT_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")  # csrc/cpu_kernels.cpp TF_Q8ACT_VNNI


@functools.cache
def cpu_has_q8act() -> bool:
    """Whether this CPU runs the int8-activation kernels' fast path (a -march=native build compiles it exactly
    when the CPU has these flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return all(flag in flags for flag in Q8ACT_FLAGS)


def kernel_for(fmt: str, n: int, k: int, group: int, device_type: str) -> str | None:
    """The packed kernel KERNELS picks for an `fmt` ("int8", "int4", "int5", "uint8") weight of (n, k) in groups of
    `group` (k: per channel), or None (dense only)."""
    if device_type == "cpu":
        if fmt in ("int4", "int8") and group % 32 == 0 and k % 64 == 0 and cpu_has_q8act():
            return f"cpu-{fmt}-q8act"
        if fmt == "int8" and group == k and k % 16 == 0:
            return "cpu-int8pack"
        if group in INT4_KERNEL_GROUPS:
            return {"int4": "cpu-int4pack", "int8": "cpu-int8-as-int4-planes",
                    "int5": "cpu-int5-as-int4-planes", "uint8": "cpu-uint8-as-int4-planes"}[fmt]
        return None
    if device_type == "cuda" and fmt == "int4" and group in INT4_KERNEL_GROUPS and k % 32 == 0 and n % 8 == 0:
        return "cuda-int4pack"
    return None


def packed_bytes(kernel: str, n: int, k: int, group: int) -> int:
    """Bytes of the packed module `kernel` builds (the buffers of layers/quant.py's kernel classes)."""
    groups = k // group
    padded = n + -n % 16  # the CPU int4 kernel takes rows in 16s
    return {"cpu-int8pack": n * k + 2 * n,  # int8 codes, a bf16 scale per row
            "cpu-int4pack": padded * k // 2 + groups * padded * 4,  # two codes a byte, bf16 scale and zero
            "cpu-int8-as-int4-planes": padded * k + 2 * groups * padded * 4,  # two int4 planes along 2K
            "cpu-int5-as-int4-planes": padded * k + 2 * groups * padded * 4,
            "cpu-uint8-as-int4-planes": padded * k + 2 * groups * padded * 4,
            "cpu-int4-q8act": n * k // 2 + 2 * n * (k // 32) * 2,  # two codes a byte, fp16 scale and min per 32
            "cpu-int8-q8act": n * k + n * (k // 32) * 2,  # a code a byte, fp16 scale per 32
            "cuda-int4pack": n * k // 2 + groups * n * 4}[kernel]


def layer_bytes(fmt: str, n: int, k: int, group: int, kernel: str | None, dense: str, dtype_bytes: int,
                reads_packed: bool | None = None, reordered: bool = False) -> int:
    """What a QuantizedLinear of this format and shape keeps. `reads_packed`: whether on-the-fly reads the
    kernel's buffers (None: as READS_PACKED says); `reordered`: an act-order weight (its input order)."""
    packed = (packed_bytes(kernel, n, k, group) if kernel else 0) + (k * INPUT_ORDER_BYTES if reordered else 0)
    if dense in DENSE_COPIES:
        return packed + DENSE_COPIES[dense] * n * k * dtype_bytes
    if reads_packed if reads_packed is not None else kernel in READS_PACKED:
        return packed
    # Codes apart: int4 two a byte, int5 one a byte, int8 the int8 kernel's own tensor when it has one;
    # scales (and mins, but for symmetric int8) in the model's dtype.
    codes = n * k // 2 if fmt == "int4" else (0 if kernel == "cpu-int8pack" else n * k)
    return packed + codes + (1 if fmt == "int8" else 2) * n * (k // group) * dtype_bytes


def auto_dense(device_type: str, copy_bytes: int, on_the_fly_bytes: int, unquantized_bytes: int,
               copy_fits: bool) -> str:
    """What `--quantization-dense auto` keeps (serve's start-up check and `tokenfactory plan --engine tokenfactory`
    both ask this): the dense copy where it fits, except on CUDA when the copy would make the layers bigger than
    not quantizing them (a bf16 copy beside int4 codes is more than bf16 alone): there the codes only, dequantized
    per large step. On a CPU the copy pays: its packed kernels lose to a dense GEMM past ~12 rows (layers/quant.py)."""
    if not copy_fits or (device_type == "cuda" and copy_bytes > unquantized_bytes and on_the_fly_bytes < copy_bytes):
        return "on-the-fly"
    return "copy"
