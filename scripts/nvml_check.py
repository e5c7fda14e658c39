"""Check the meter's nvml source on an NVIDIA GPU: J/token at batch 1 and batch 32, against the counter.

    python scripts/nvml_check.py --out results/nvml-check.json               # on a GPU machine
    python scripts/nvml_check.py --device cpu --source modelled --steps 20   # a dry run anywhere

A random-weight Llama-shaped decoder (no checkpoint: weights are torch.randn, fixed seed) decodes
`--steps` tokens per sequence at batch 1 and at batch 32 over a KV cache of `--context` tokens. Each
step is reported to a Meter as the engine would (one StepStats, one SequenceWork per sequence), with
an idle pause before each phase. For each phase the script reports:

- J/token from the meter: Σ per-request joules / tokens generated (idle excluded);
- the counter's own total over the phase, read directly through pynvml (nvmlDeviceGetTotalEnergyConsumption),
  and the meter's accounting of the same window (Σ requests + idle + unattributed), with their gap;
- mean watts while busy and while idle.

Expected on a large GPU: J/token at batch 32 far below batch 1 (decode is memory-bound, so a step
of 32 costs about as much as a step of 1), and the accounting gap within the counter's resolution.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenfactory.meter.attribution import Meter, MeterConfig
from tokenfactory.meter.power import PowerConfig
from tokenfactory.meter.prices import load_prices
from tokenfactory.meter.sources import choose_power_source
from tokenfactory.types import SequenceWork, StepStats


@dataclass(frozen=True)
class Shape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    vocab_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        return self.num_layers * (4 * h * h + 3 * h * i) + 2 * self.vocab_size * h


class RandomDecoder(torch.nn.Module):
    """Llama-shaped decode step over a fixed random KV cache (attention reads `context` keys)."""

    def __init__(self, shape: Shape, batch: int, context: int, device: str, dtype: torch.dtype) -> None:
        super().__init__()
        h, i, L = shape.hidden_size, shape.intermediate_size, shape.num_layers
        kw = dict(device=device, dtype=dtype)
        self.shape = shape
        self.qkv = [torch.randn(h, 3 * h, **kw) / math.sqrt(h) for _ in range(L)]
        self.o = [torch.randn(h, h, **kw) / math.sqrt(h) for _ in range(L)]
        self.gate_up = [torch.randn(h, 2 * i, **kw) / math.sqrt(h) for _ in range(L)]
        self.down = [torch.randn(i, h, **kw) / math.sqrt(i) for _ in range(L)]
        self.lm_head = torch.randn(h, shape.vocab_size, **kw) / math.sqrt(h)
        cache = (batch, shape.num_heads, context, shape.head_dim)
        self.k = [torch.randn(cache, **kw) for _ in range(L)]  # (B, nh, T, hd)
        self.v = [torch.randn(cache, **kw) for _ in range(L)]

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 1, h)
        B, nh, hd = x.shape[0], self.shape.num_heads, self.shape.head_dim
        for layer in range(self.shape.num_layers):
            q, _, _ = (x @ self.qkv[layer]).split(self.shape.hidden_size, dim=-1)  # (B, 1, h) each
            q = q.view(B, 1, nh, hd).transpose(1, 2)  # (B, nh, 1, hd)
            a = torch.nn.functional.scaled_dot_product_attention(q, self.k[layer], self.v[layer])  # (B, nh, 1, hd)
            x = x + a.transpose(1, 2).reshape(B, 1, -1) @ self.o[layer]
            gate, up = (x @ self.gate_up[layer]).chunk(2, dim=-1)  # (B, 1, i) each
            x = x + (torch.nn.functional.silu(gate) * up) @ self.down[layer]
            x = x / x.float().pow(2).mean(-1, keepdim=True).add(1e-5).sqrt().to(x.dtype)  # keep it bounded
        return (x @ self.lm_head).argmax(-1)  # (B, 1)


class RawCounter:
    """The GPUs' own energy counters through pynvml, independent of the meter's code."""

    def __init__(self, indices: list[int]) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]

    def joules(self) -> float:
        return sum(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self._handles) / 1000.0


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_phase(args: argparse.Namespace, shape: Shape, batch: int, raw: RawCounter | None) -> dict:
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = RandomDecoder(shape, batch, args.context, args.device, dtype)
    x = torch.randn(batch, 1, shape.hidden_size, device=args.device, dtype=dtype)
    for _ in range(5):  # warm-up: kernels chosen, clocks up
        model(x)
    sync(args.device)
    choice = choose_power_source(PowerConfig(source=args.source, gpu_indices=(args.gpu,)))
    source = choice.source
    if source.unavailable_reason:
        raise SystemExit(f"power source {args.source} cannot measure here: {source.unavailable_reason}")
    raw_start = raw.joules() if raw else None
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else None
    meter = Meter(source, shape, load_prices(device_name=device_name), MeterConfig(tick_interval_s=0.1)).start()
    time.sleep(args.idle_s)  # idle, read by the ticker
    busy_start = time.monotonic()
    for step in range(args.steps):
        start = time.monotonic()
        model(x)
        sync(args.device)
        work = tuple(SequenceWork(f"b{batch}-{i}", 1, args.context + step, False) for i in range(batch))
        meter.on_step(StepStats(step, start, time.monotonic() - start, 0, batch, batch, 0, 0, 1, 0, work))
    busy_s = time.monotonic() - busy_start
    results = [meter.finish_request(f"b{batch}-{i}", args.steps) for i in range(batch)]
    meter.close()
    totals = meter.totals()
    raw_end = raw.joules() if raw else None
    request_j = sum(r.energy_joules for r in results)
    source_j = totals.energy_joules_by_source[source.name]
    accounted = request_j + totals.idle_joules + totals.unattributed_joules + totals.unsettled_joules
    source.close()
    return {
        "batch": batch, "steps": args.steps, "tokens": batch * args.steps, "busy_s": busy_s,
        "source": source.describe(), "skipped": list(choice.skipped),
        "joules_per_token": request_j / (batch * args.steps),
        "request_joules": request_j, "idle_joules": totals.idle_joules,
        "unattributed_joules": totals.unattributed_joules,
        "unsettled_joules": totals.unsettled_joules,
        "meter_accounted_joules": accounted, "source_total_joules": source_j,
        "accounting_gap_joules": accounted - source_j,  # should be ~0 (floating point)
        # the raw window starts a little earlier and ends a little later than the meter's
        "raw_counter_joules": None if raw is None else raw_end - raw_start,
        "busy_watts": request_j / busy_s if busy_s > 0 else None,
        "idle_watts": totals.idle_joules / args.idle_s if args.idle_s > 0 else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--source", default="nvml")
    parser.add_argument("--gpu", type=int, default=0, help="NVML index of the GPU the model runs on")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--idle-s", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=Path("results/nvml-check.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    shape = Shape(args.layers, args.hidden, 4 * args.hidden, max(args.hidden // 128, 1), 32000)
    raw = RawCounter([args.gpu]) if args.source == "nvml" else None
    phases = [run_phase(args, shape, batch, raw) for batch in (1, 32)]
    report = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
              "params": shape.num_params, "context": args.context, "phases": phases,
              "j_per_token_ratio_b1_over_b32": phases[0]["joules_per_token"] / phases[1]["joules_per_token"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
