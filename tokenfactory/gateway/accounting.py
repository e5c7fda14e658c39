"""Energy, money and the ledger for each API request, between the meter and the HTTP side.

One API request may be several engine requests (a completions call with a list of prompts); its energy
and cost are their sums, and it gets one ledger row. The row is committed before the response's last
byte is sent: `settle()` is awaited before the final body or the final stream chunks are written.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from tokenfactory.meter.attribution import Meter, RequestEnergy
from tokenfactory.meter.ledger import Ledger, row_for
from tokenfactory.types import RequestOutput


def merge_energy(api_request_id: str, parts: Sequence[RequestEnergy]) -> RequestEnergy:
    """Sum of the parts; energy (and cost) is None if any part's is (missing is never 0)."""
    first = parts[0]

    def total(name: str) -> float | None:
        values = [getattr(p, name) for p in parts]
        return None if any(v is None for v in values) else sum(values)

    outputs = [p.num_output_tokens for p in parts]
    return dataclasses.replace(
        first, request_id=api_request_id, energy_joules=total("energy_joules"),
        facility_energy_joules=total("facility_energy_joules"), device_seconds=sum(p.device_seconds for p in parts),
        flops=sum(p.flops for p in parts), num_steps=sum(p.num_steps for p in parts),
        num_output_tokens=None if any(o is None for o in outputs) else sum(outputs),  # type: ignore[arg-type]
        cost_device_usd=sum(p.cost_device_usd for p in parts), cost_energy_usd=total("cost_energy_usd"),
        cost_usd=total("cost_usd"))


def usage_fields(energy: RequestEnergy) -> dict[str, object]:
    return {"energy_joules": energy.energy_joules, "energy_source": energy.energy_source,
            "energy_scope": energy.energy_scope, "energy_overhead_factor": energy.energy_overhead_factor,
            "facility_energy_joules": energy.facility_energy_joules,
            "joules_per_output_token": energy.joules_per_output_token,
            "cost_usd": energy.cost_usd, "cost_device_usd": energy.cost_device_usd,
            "cost_energy_usd": energy.cost_energy_usd}


class Accounting:
    def __init__(self, meter: Meter, ledger: Ledger, model_name: str) -> None:
        self.meter, self.ledger, self.model_name = meter, ledger, model_name

    async def settle(self, api_request_id: str, engine_ids: Sequence[str], finals: Sequence[RequestOutput | None],
                     status: str, tenant: str = "anonymous") -> dict[str, object]:
        """Finish the request with the meter, commit its ledger row, and return the usage fields.
        `finals[i]` is engine request i's last output (None if it never produced one)."""
        parts = []
        for rid, out in zip(engine_ids, finals, strict=True):
            num_out = sum(len(c.token_ids) for c in out.outputs) if out is not None else 0
            parts.append(self.meter.finish_request(rid, num_out))
        energy = merge_energy(api_request_id, parts)
        done = [o for o in finals if o is not None]
        metrics = [o.metrics for o in done if o.metrics is not None]
        first_tokens = [m.first_token_time for m in metrics if m.first_token_time is not None]
        arrivals = [m.arrival_time for m in metrics]
        ends = [m.finished_time or m.last_token_time for m in metrics]
        row = row_for(
            energy, model=self.model_name, status=status, tenant=tenant,
            prompt_tokens=sum(len(o.prompt_token_ids) for o in done),
            completion_tokens=sum(len(c.token_ids) for o in done for c in o.outputs),
            cached_tokens=sum(o.num_cached_tokens for o in done),
            ttft_s=min(first_tokens) - min(arrivals) if first_tokens and arrivals else None,
            latency_s=max(e for e in ends if e is not None) - min(arrivals)
            if arrivals and any(e is not None for e in ends) else None)
        await asyncio.to_thread(self.ledger.record, row)
        return usage_fields(energy)
