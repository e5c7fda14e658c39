"""Fused against unfused decode steps of the bundled model in one process, interleaved (issue 29): the CPU time
of the stepping thread per token, which waiting for a core does not inflate on a shared machine.

    python scripts/fused_decode_ab.py [THREADS]
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch

import tokenfactory.layers.activation as activation
import tokenfactory.layers.attention as attention
import tokenfactory.layers.norm as norm
from tokenfactory.config import EngineConfig
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.layers import cpu_kernels
from tokenfactory.types import SamplingParams


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    engine = LLMEngine(EngineConfig(max_num_seqs=8, machine_profile="off"))
    engine.warmup()
    prompt = [random.Random(1).randrange(100, 49000) for _ in range(128)]
    cpu_ms: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(6):
        for fused in (False, True):
            for module in (attention, norm, activation):
                module.fused_kernels = cpu_kernels.fused_kernels if fused else (lambda: None)
            engine.reset_prefix_cache()
            engine.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True, temperature=0))
            engine.step()  # the prefill
            while engine.has_unfinished_requests:
                start = time.thread_time()
                engine.step()
                cpu_ms[fused].append((time.thread_time() - start) * 1e3)
    for fused, times in cpu_ms.items():
        print(f"{'fused' if fused else 'unfused'}: CPU ms a token, median {statistics.median(times):.2f}, "
              f"p10 {sorted(times)[len(times) // 10]:.2f}")


if __name__ == "__main__":
    main()
