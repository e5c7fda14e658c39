"""The meter fed by the real engine (bundled SmolLM2) through its step listeners."""

import pytest

from tokenfactory.meter.attribution import Meter, MeterConfig
from tokenfactory.meter.power import ConstantSource
from tokenfactory.meter.prices import load_prices
from tokenfactory.types import SamplingParams


@pytest.mark.slow
def test_engine_steps_are_metered_and_the_books_balance():
    from tokenfactory.engine.llm import LLM

    llm = LLM()
    meter = Meter(ConstantSource(100.0, "machine"), llm.engine.model_config, load_prices(),
                  MeterConfig(tick_interval_s=None))
    llm.engine.step_listeners.append(meter.on_step)
    prompts = ["Hi", "Tell me about the history of the city of Paris, its rivers, bridges and its people. " * 4]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    short, long = (meter.finish_request(o.request_id, len(o.outputs[0].token_ids)) for o in outs)
    assert short.energy_source == "constant" and short.energy_scope == "machine"
    assert short.num_steps >= 8 and long.num_steps >= 8
    assert long.energy_joules > short.energy_joules > 0  # same output, longer prompt: more FLOPs
    assert long.flops > short.flops
    totals = meter.totals()
    books = (short.energy_joules + long.energy_joules + totals.idle_joules + totals.unattributed_joules
             + totals.unsettled_joules)
    assert books == pytest.approx(totals.energy_joules_by_source["constant"], rel=1e-9)
    assert totals.num_output_tokens == 16
    assert totals.joules_per_output_token == pytest.approx((short.energy_joules + long.energy_joules) / 16, rel=1e-9)
