"""The public testing helpers behave as documented."""

from __future__ import annotations

import anyio
import pytest

from agentfsm import Outcome, Runtime
from agentfsm.exceptions import ProviderError
from agentfsm.testing import ScriptedProvider, call, calls, text
from tests.helpers import request


async def test_a_script_one_step_short_fails_the_loop() -> None:
    """Past the end of its script a loop fails, with an error naming the step count."""
    provider = ScriptedProvider([calls(call("add", a=1, b=2))])
    with anyio.fail_after(10):
        async with Runtime(providers={"scripted": provider}) as runtime:
            result = await runtime.wait(runtime.run_loop("a", "go", request()))
    assert result.outcome is Outcome.failed
    assert result.error is not None
    assert result.error.type == "ProviderError"
    assert "the script has 1 steps" in result.error.message
    assert f"loop {result.loop_id} asked for step 2" in result.error.message
    assert len(provider.requests) == 2  # it did not start the script over
    assert result.tool_calls == 1


async def test_each_loop_plays_the_script_from_the_start() -> None:
    """A finished loop does not use up the script for the next loop."""
    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    with anyio.fail_after(10):
        async with Runtime(providers={"scripted": provider}) as runtime:
            for _ in range(3):
                result = await runtime.wait(runtime.run_loop("a", "1+2?", request()))
                assert result.outcome is Outcome.answered
                assert result.answer is not None
                assert result.answer.content == "3"


async def test_outside_a_loop_the_script_ends_too() -> None:
    """Called directly, the provider plays its script once, then raises."""
    provider = ScriptedProvider([text("one"), text("two")])
    outputs = [await provider.complete(request()) for _ in range(2)]
    assert [o.message.content for o in outputs if o.message] == ["one", "two"]
    with pytest.raises(ProviderError, match="has 2 steps and outside a loop"):
        await provider.complete(request())


async def test_an_empty_script_raises_at_once() -> None:
    """A script with no steps raises on the first request."""
    with pytest.raises(ProviderError, match="has 0 steps"):
        await ScriptedProvider([]).complete(request())
