"""Tool approval: pausing a batch for a person, approving, denying, cancelling."""

from __future__ import annotations

from agentfsm import (
    LoopStatus,
    Outcome,
    PendingTransition,
    Rewrite,
    Runtime,
    ToolBatch,
    Trigger,
    tool,
)
from agentfsm.events import (
    LoopPaused,
)
from agentfsm.providers.function import FunctionProvider
from agentfsm.testing import (
    EventRecorder,
    ScriptedProvider,
    call,
    calls,
    text,
)
from tests.helpers import items_of, request, wait_until


class TestApproval:
    async def test_one_approved_one_denied_after_a_thousand_other_loops(self) -> None:
        """A paused approval survives 1,000 other loops; resume approves one, denies one."""
        ran: list[int] = []

        @tool(needs_approval=lambda args: args["n"] > 10)
        async def pay(n: int) -> str:
            """Pays n."""
            ran.append(n)
            return f"paid {n}"

        provider = ScriptedProvider(
            [
                calls(
                    call("pay", call_id="small", n=5),
                    call("pay", call_id="big", n=50),
                    call("pay", call_id="huge", n=500),
                ),
                text("done"),
            ]
        )
        others = FunctionProvider(lambda req: text("other"))
        async with Runtime(
            providers={"scripted": provider, "other": others}
        ) as runtime:
            recorder = EventRecorder(runtime.bus, ["loop.paused", "loop.resumed"])
            inference_input = request(pay)
            loop_id = runtime.run_loop("agent", "pay them", inference_input)
            await wait_until(lambda: runtime.get(loop_id).status is LoopStatus.paused)
            ids = [
                runtime.run_loop(f"o{i}", "hi", request(model="other:x"))
                for i in range(1000)
            ]
            for other in ids:
                await runtime.wait(other)
            view = runtime.get(loop_id)
            assert view.pending is not None
            batch = view.pending.payload
            assert isinstance(batch, ToolBatch)
            assert batch.awaiting_approval == ("big", "huge")
            assert ran == []  # nothing ran before the approval
            runtime.resume(loop_id, Rewrite(payload=batch.deny("huge", "too much")))
            result = await runtime.wait(loop_id)
        assert ran == [5, 50]
        assert items_of(inference_input.context) == [
            "user:pay them",
            "call:small",
            "call:big",
            "call:huge",
            "out:small=paid 5",
            "out:big=paid 50",
            "out:huge=ERR",
            "model:done",
        ]
        assert result.outcome is Outcome.answered
        paused = recorder.events[0]
        assert isinstance(paused, LoopPaused)
        assert paused.reason == "approval required: pay"
        assert [e.type for e in recorder.events] == ["loop.paused", "loop.resumed"]

    async def test_an_approved_batch_still_goes_through_the_users_handlers(
        self,
    ) -> None:
        """Resuming after the approval gate runs the handlers after it: a user's
        handler can still deny an approved call."""
        ran: list[str] = []

        @tool(needs_approval=True)
        async def rm(path: str) -> str:
            """Deletes."""
            ran.append(path)
            return "removed"

        def deny_root(pending: PendingTransition) -> Rewrite | None:
            batch = pending.payload
            if pending.trigger is not Trigger.call_tools:
                return None
            assert isinstance(batch, ToolBatch)
            return Rewrite(payload=batch.deny("r", "not the root"))

        provider = ScriptedProvider(
            [calls(call("rm", call_id="r", path="/")), text("ok")]
        )
        async with Runtime(providers={"scripted": provider}) as runtime:
            inference_input = request(rm)
            loop_id = runtime.run_loop("agent", "clean up", inference_input, deny_root)
            await wait_until(lambda: runtime.get(loop_id).status is LoopStatus.paused)
            runtime.resume(loop_id)
            await runtime.wait(loop_id)
        assert ran == []
        assert "out:r=ERR" in items_of(inference_input.context)

    async def test_cancel_during_a_paused_approval(self) -> None:
        """Cancelling a loop waiting for approval ends it cancelled; no call ran."""

        @tool(needs_approval=True)
        async def rm(path: str) -> str:
            """Deletes."""
            raise AssertionError("must not run")

        provider = ScriptedProvider([calls(call("rm", call_id="r", path="/"))])
        async with Runtime(providers={"scripted": provider}) as runtime:
            inference_input = request(rm)
            loop_id = runtime.run_loop("agent", "clean up", inference_input)
            await wait_until(lambda: runtime.get(loop_id).status is LoopStatus.paused)
            runtime.cancel(loop_id, "user left")
            result = await runtime.wait(loop_id)
        assert (result.outcome, result.reason) == (Outcome.cancelled, "user left")
        assert items_of(inference_input.context) == ["user:clean up"]

    async def test_the_gate_is_in_a_loop_of_any_gated_tool_only(self) -> None:
        """A loop gets the approval gate when any of its tools needs approval,
        the first or a later one (the batch pauses for it); a loop with none
        answers."""

        @tool
        async def look() -> str:
            """Looks."""
            return "seen"

        @tool(needs_approval=True)
        async def pay() -> str:
            """Pays."""
            return "paid"

        script = [calls(call("look"), call("pay")), text("done")]
        provider = ScriptedProvider(script * 3)
        async with Runtime(providers={"scripted": provider}) as runtime:
            for tools in ((look, pay), (pay, look)):
                loop_id = runtime.run_loop("agent", "go", request(*tools))
                await wait_until(
                    lambda: runtime.get(loop_id).status is LoopStatus.paused  # noqa: B023
                )
                runtime.cancel(loop_id)
                assert (await runtime.wait(loop_id)).outcome is Outcome.cancelled
            # `pay` unknown here: an error output, and nothing to approve.
            result = await runtime.wait(runtime.run_loop("agent", "go", request(look)))
        assert result.outcome is Outcome.answered


def test_the_gates_name_is_the_one_records_give_it() -> None:
    """`interception.APPROVAL_GATE` is how records name the gate (replay and
    forks leave it out of the handlers they rebind): it must stay the
    gate's own `module:qualname`."""
    from agentfsm._loop.intercept import approval_gate
    from agentfsm.interception import APPROVAL_GATE
    from agentfsm.record import callable_name

    assert callable_name(approval_gate) == APPROVAL_GATE
