"""The OpenAI Agents SDK's check, shared by the chat-completions and Responses tests: an agent whose function tool
must be called (tool_choice "required") and whose result it reads back."""

from __future__ import annotations

import asyncio
from typing import Any


def run_clock_agent(model: Any) -> None:
    """Run the clock agent on `model` (a model object, or a name for the SDK's default client) and check its turn."""
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.items import MessageOutputItem, ToolCallOutputItem

    set_tracing_disabled(True)
    zones: list[str] = []

    @function_tool
    def get_time(zone: str) -> str:
        """The current time in a time zone."""
        zones.append(zone)
        return f"It is 12:34 in {zone}."

    # The SDK resets tool_choice after the call (reset_tool_choice), so the second turn reads the result freely.
    agent = Agent(name="clock", instructions="Tell the user the time.", tools=[get_time], model=model,
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=80,
                                               temperature=0.3))
    result = asyncio.run(Runner.run(agent, "What time is it in UTC?", max_turns=4))
    assert zones and all(isinstance(z, str) for z in zones)
    outputs = [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    assert outputs and "12:34" in str(outputs[0].output)
    assert isinstance(result.new_items[-1], MessageOutputItem) and isinstance(result.final_output, str)
