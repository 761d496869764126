"""Loop control: queues, limits, tool execution modes, wrappers, approval, errors."""

from __future__ import annotations

import weakref

import anyio
import pytest
from pydantic import BaseModel

from agentfsm import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    LoopState,
    LoopStatus,
    ModelContext,
    ModelMessageItem,
    ModelRequest,
    Outcome,
    PendingTransition,
    ProviderError,
    RequestMetadata,
    Rewrite,
    Runtime,
    TokenUsage,
    ToolBatch,
    ToolCall,
    ToolResult,
    Trigger,
    TurnSnapshot,
    UserMessage,
    after_turns,
    report_progress,
    tool,
    tool_called,
)
from agentfsm._loop.repair import context_scan
from agentfsm.events import (
    FunctionCallCompleted,
    FunctionCallProgress,
    LoopIdle,
    LoopPaused,
    ModelAnswer,
)
from agentfsm.exceptions import ConfigurationError, LoopStateError
from agentfsm.providers import ModelNext
from agentfsm.providers.function import FunctionProvider
from agentfsm.testing import (
    EventRecorder,
    ScriptedProvider,
    assert_path,
    call,
    calls,
    text,
)
from agentfsm.tools import ToolNext
from tests.helpers import add, request, wait_until


def items_of(context: ModelContext) -> list[str]:
    """A compact view of a context: `user:hi`, `call:c1`, `out:c1=3`, `model:done`."""
    view = []
    for item in context.items:
        if isinstance(item, UserMessage):
            view.append(f"user:{item.content}")
        elif isinstance(item, FunctionCallItem):
            view.append(f"call:{item.call_id}")
        elif isinstance(item, FunctionCallOutputItem):
            view.append(f"out:{item.call_id}={'ERR' if item.is_error else item.output}")
        elif isinstance(item, ModelMessageItem):
            view.append(f"model:{item.content}")
    return view


class TestQueues:
    async def test_steering_during_a_tool_batch(self) -> None:
        """Steering sent while a tool runs enters after the tool outputs, before the next request."""
        running, release = anyio.Event(), anyio.Event()

        @tool
        async def slow(n: int) -> int:
            """Waits for the test."""
            running.set()
            await release.wait()
            return n

        provider = ScriptedProvider(
            [
                calls(call("slow", call_id="a", n=1), call("slow", call_id="b", n=2)),
                text("done"),
            ]
        )
        async with Runtime(providers={"scripted": provider}) as runtime:
            recorder = EventRecorder(
                runtime.bus, ["loop.transition", "function_call.completed"]
            )
            inference_input = request(slow)
            loop_id = runtime.run_loop("agent", "go", inference_input)
            with anyio.fail_after(5):
                await running.wait()
            runtime.steer(loop_id, "also consider c")
            release.set()
            result = await runtime.wait(loop_id)
        assert items_of(inference_input.context) == [
            "user:go",
            "call:a",
            "call:b",
            "out:a=1",
            "out:b=2",
            "user:also consider c",
            "model:done",
        ]
        assert_path(
            result,
            "idle context_update inference function_call context_update inference "
            "model_message idle",
        )
        assert result.path[3].trigger is Trigger.steer
        assert recorder.types(loop_id) == [
            "loop.transition",
            "loop.transition",
            "loop.transition",
            "function_call.completed",
            "function_call.completed",
            "loop.transition",
            "loop.transition",
            "loop.transition",
            "loop.transition",
        ]

    async def test_steering_before_the_first_request(self) -> None:
        """Steering queued before the loop runs joins the first request."""
        provider = ScriptedProvider([text("ok")])
        async with Runtime(providers={"scripted": provider}) as runtime:
            inference_input = request()
            loop_id = runtime.run_loop("agent", "first", inference_input)
            runtime.steer(loop_id, "second")
            await runtime.wait(loop_id)
        assert items_of(inference_input.context) == [
            "user:first",
            "user:second",
            "model:ok",
        ]
        assert items_of(provider.requests[0].context)[:2] == [
            "user:first",
            "user:second",
        ]

    async def test_follow_up_after_an_answer(self) -> None:
        """A follow-up is sent after the answer; model.answer is published for each."""
        gate = anyio.Event()

        async def model(req: InferenceInput) -> InferenceOutput:
            last = req.context.items[-1]
            assert isinstance(last, UserMessage)
            if last.content == "q1":
                await gate.wait()
            return text(f"a:{last.content}")

        async with Runtime(providers={"fn": FunctionProvider(model)}) as runtime:
            recorder = EventRecorder(runtime.bus, "model.answer")
            inference_input = request(model="fn:x")
            loop_id = runtime.run_loop("agent", "q1", inference_input)
            runtime.follow_up(loop_id, "q2")
            runtime.follow_up(loop_id, "q3")
            gate.set()
            result = await runtime.wait(loop_id)
            with pytest.raises(LoopStateError, match="has ended"):
                runtime.follow_up(loop_id, "too late")
        assert items_of(inference_input.context) == [
            "user:q1",
            "model:a:q1",
            "user:q2",
            "user:q3",
            "model:a:q3",
        ]
        assert result.answer == ModelMessageItem(content="a:q3")
        assert result.path[3].trigger is Trigger.follow_up
        answers = [
            e.message.content for e in recorder.events if isinstance(e, ModelAnswer)
        ]
        assert answers == ["a:q1", "a:q3"]

    async def test_one_at_a_time_follow_ups(self) -> None:
        """follow_up_mode='one-at-a-time' sends one queued message per turn."""

        def model(req: InferenceInput) -> InferenceOutput:
            last = req.context.items[-1]
            assert isinstance(last, UserMessage)
            return text(f"a:{last.content}")

        async with Runtime(providers={"fn": FunctionProvider(model)}) as runtime:
            inference_input = request(model="fn:x")
            loop_id = runtime.run_loop(
                "agent", "q1", inference_input, follow_up_mode="one-at-a-time"
            )
            runtime.follow_up(loop_id, "q2")
            runtime.follow_up(loop_id, "q3")
            result = await runtime.wait(loop_id)
        assert items_of(inference_input.context) == [
            "user:q1",
            "model:a:q1",
            "user:q2",
            "model:a:q2",
            "user:q3",
            "model:a:q3",
        ]
        assert result.model_requests == 3

    async def test_nothing_queued_ends_as_before(self) -> None:
        """Without queued messages the loop ends after its answer."""
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("x")])}
        ) as runtime:
            result = await runtime.wait(runtime.run_loop("agent", "q", request()))
        assert_path(result, "idle context_update inference model_message idle")


class TestLimits:
    async def test_max_turns_with_tools_pending_and_a_queued_follow_up(self) -> None:
        """At max_turns the requested tools finish, no request follows, the queue stays."""
        provider = ScriptedProvider(
            [
                calls(
                    call("add", call_id="a", a=1, b=1),
                    call("add", call_id="b", a=2, b=2),
                )
            ]
        )
        async with Runtime(providers={"scripted": provider}) as runtime:
            recorder = EventRecorder(runtime.bus, "loop.idle")
            inference_input = request()
            loop_id = runtime.run_loop("agent", "go", inference_input, max_turns=1)
            runtime.follow_up(loop_id, "not consumed")
            result = await runtime.wait(loop_id)
        assert (result.outcome, result.reason) == (Outcome.stopped, "max_turns")
        assert items_of(inference_input.context) == [
            "user:go",
            "call:a",
            "call:b",
            "out:a=2",
            "out:b=4",
        ]
        assert result.path[-1].trigger is Trigger.stop
        idle = recorder.events[-1]
        assert isinstance(idle, LoopIdle)
        assert (idle.model_requests, idle.tool_calls) == (1, 2)

    async def test_max_turns_is_bounded(self) -> None:
        """max_turns has a hard cap, and unknown options are named."""
        async with Runtime(providers={"scripted": ScriptedProvider([])}) as runtime:
            with pytest.raises(
                ConfigurationError, match=r"max_turns must be in 1\.\.10000"
            ):
                runtime.run_loop("agent", "x", request(), max_turns=10_001)
            with pytest.raises(
                ConfigurationError, match="unknown loop options: max_turn"
            ):
                runtime.run_loop("agent", "x", request(), max_turn=3)  # type: ignore[call-arg]

    @pytest.mark.parametrize(
        ("condition", "reason", "requests"),
        [
            pytest.param(tool_called("add"), "tool_called:add", 1, id="tool-called"),
            pytest.param(after_turns(2), "turn_count", 2, id="turn-count"),
            pytest.param(
                lambda view: "two tools" if view.tool_calls >= 2 else None,
                "two tools",
                2,
                id="callable",
            ),
        ],
    )
    async def test_stop_when(
        self, condition: object, reason: str, requests: int
    ) -> None:
        """The first stop condition that holds ends the loop stopped, with its reason."""
        provider = ScriptedProvider(
            [calls(call("add", a=1, b=1))] * 3 + [text("never")]
        )
        async with Runtime(providers={"scripted": provider}) as runtime:
            result = await runtime.wait(
                runtime.run_loop("agent", "go", request(), stop_when=[condition])  # type: ignore[list-item]
            )
        assert (result.outcome, result.reason, result.model_requests) == (
            Outcome.stopped,
            reason,
            requests,
        )

    async def test_inference_timeout_names_what_timed_out(self) -> None:
        """A request past inference_timeout is retried, then fails naming the model."""

        async def slow(req: InferenceInput) -> InferenceOutput:
            await anyio.sleep(10)
            return text("late")

        async with Runtime(providers={"fn": FunctionProvider(slow)}) as runtime:
            result = await runtime.wait(
                runtime.run_loop(
                    "agent",
                    "q",
                    request(model="fn:slow"),
                    inference_timeout=0.02,
                    max_retries=1,
                    retry_backoff=0,
                )
            )
        assert result.error is not None
        assert (result.error.type, result.error.message) == (
            "ProviderTimeout",
            "the request to 'fn:slow' timed out after 0.02s",
        )

    async def test_loop_deadline(self) -> None:
        """A loop past its deadline fails with LoopTimeout; its calls still get outputs."""

        @tool
        async def forever() -> str:
            """Never ends."""
            await anyio.sleep_forever()
            return "x"

        provider = ScriptedProvider([calls(call("forever", call_id="f"))])
        async with Runtime(providers={"scripted": provider}) as runtime:
            inference_input = request(forever)
            result = await runtime.wait(
                runtime.run_loop("agent", "q", inference_input, deadline=0.05)
            )
        assert result.error is not None
        assert result.error.type == "LoopTimeout"
        assert "deadline of 0.05s" in result.error.message
        assert items_of(inference_input.context) == ["user:q", "call:f", "out:f=ERR"]


class TestToolExecution:
    async def test_parallel_batch_finishing_out_of_order(self) -> None:
        """Parallel calls: completion events in finish order, context in the model's order."""
        order: list[str] = []
        gates = {name: anyio.Event() for name in ("a", "b", "c")}

        @tool
        async def step(name: str) -> str:
            """Waits for its gate."""
            await gates[name].wait()
            order.append(name)
            return name

        provider = ScriptedProvider(
            [
                calls(*(call("step", call_id=n, name=n) for n in ("a", "b", "c"))),
                text("done"),
            ]
        )
        async with Runtime(providers={"scripted": provider}) as runtime:
            recorder = EventRecorder(runtime.bus, "function_call.*")
            inference_input = request(step)
            loop_id = runtime.run_loop(
                "agent", "go", inference_input, tool_execution="parallel"
            )
            await wait_until(lambda: len(recorder.events) == 3)  # all three started
            for name in ("c", "a", "b"):
                gates[name].set()
                await anyio.wait_all_tasks_blocked()
            await runtime.wait(loop_id)
        assert order == ["c", "a", "b"]
        completed = [
            e.output.call_id
            for e in recorder.events
            if isinstance(e, FunctionCallCompleted)
        ]
        assert completed == ["c", "a", "b"]
        assert items_of(inference_input.context) == [
            "user:go",
            "call:a",
            "call:b",
            "call:c",
            "out:a=a",
            "out:b=b",
            "out:c=c",
            "model:done",
        ]

    async def test_concurrency_cap_and_sequential_tools(self) -> None:
        """max_tool_concurrency caps a parallel batch; a sequential tool serializes its batch."""
        running = 0
        peak = 0

        async def work() -> None:
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            await anyio.sleep(0.01)
            running -= 1

        @tool
        async def par(n: int) -> int:
            """Parallel-safe."""
            await work()
            return n

        @tool(execution_mode="sequential")
        async def seq(n: int) -> int:
            """Must run alone."""
            await work()
            return n

        batch = calls(*(call("par", n=i) for i in range(6)))
        mixed = calls(call("par", n=1), call("seq", n=2), call("par", n=3))
        async with Runtime(
            providers={
                "scripted": ScriptedProvider([batch, text("x")]),
                "mixed": ScriptedProvider([mixed, text("y")]),
            }
        ) as runtime:
            await runtime.wait(
                runtime.run_loop(
                    "a",
                    "go",
                    request(par),
                    tool_execution="parallel",
                    max_tool_concurrency=2,
                )
            )
            capped, peak = peak, 0
            await runtime.wait(
                runtime.run_loop(
                    "a",
                    "go",
                    request(par, seq, model="mixed:x"),
                    tool_execution="parallel",
                )
            )
        assert capped == 2
        assert peak == 1

    async def test_progress_is_published_and_dropped_after_the_call(self) -> None:
        """A tool reports progress (async and from a worker thread); late progress is dropped."""
        late: list[bool] = []

        @tool
        async def fetch(url: str) -> str:
            """Reports progress."""
            report_progress({"done": 0.5})
            return "body"

        @tool
        def crunch() -> str:
            """Sync tool in a thread."""
            report_progress("halfway")
            return "crunched"

        provider = ScriptedProvider(
            [
                calls(call("fetch", call_id="f", url="u")),
                calls(call("crunch", call_id="c")),
                text("ok"),
            ]
        )
        async with Runtime(providers={"scripted": provider}) as runtime:
            recorder = EventRecorder(runtime.bus, "function_call.*")
            await runtime.wait(runtime.run_loop("agent", "go", request(fetch, crunch)))
        late.append(report_progress("after"))
        assert [e.type for e in recorder.events] == [
            "function_call.started",
            "function_call.progress",
            "function_call.completed",
            "function_call.started",
            "function_call.progress",
            "function_call.completed",
        ]
        progress = [
            e.progress for e in recorder.events if isinstance(e, FunctionCallProgress)
        ]
        assert progress == [{"done": 0.5}, "halfway"]
        assert late == [False]

    async def test_terminate_needs_every_output_to_ask(self) -> None:
        """A batch stops the loop only when every output asks to terminate."""

        @tool
        async def done(final: bool) -> ToolResult:
            """Maybe terminate."""
            return ToolResult(output="ok", terminate=final)

        mixed = calls(
            call("done", call_id="x", final=True),
            call("done", call_id="y", final=False),
        )
        both = calls(
            call("done", call_id="p", final=True), call("done", call_id="q", final=True)
        )
        provider = ScriptedProvider([mixed, both, text("never")])
        async with Runtime(providers={"scripted": provider}) as runtime:
            inference_input = request(done)
            result = await runtime.wait(
                runtime.run_loop("agent", "go", inference_input)
            )
        assert (result.outcome, result.reason, result.model_requests) == (
            Outcome.stopped,
            "terminated",
            2,
        )
        assert items_of(inference_input.context)[-4:] == [
            "call:p",
            "call:q",
            "out:p=ok",
            "out:q=ok",
        ]
        assert result.path[-1].trigger is Trigger.stop

    async def test_tool_wrappers_compose_outermost_first(self) -> None:
        """Wrappers change arguments, deny, answer without running, override and retry."""
        trace: list[str] = []
        attempts = 0

        @tool
        async def flaky(n: int) -> int:
            """Fails once."""
            nonlocal attempts
            attempts += 1
            if attempts == 1:
                raise RuntimeError("transient")
            return n

        async def outer(c: ToolCall, next: ToolNext) -> ToolResult:
            trace.append(f"outer>{c.call.call_id}")
            if c.call.call_id == "deny":
                return ToolResult.error("denied: not today")
            result = await next(c)
            trace.append(f"outer<{c.call.call_id}")
            return result.model_copy(update={"output": result.output + "!"})

        async def args_and_cache(c: ToolCall, next: ToolNext) -> ToolResult:
            trace.append(f"inner>{c.call.call_id}")
            if c.call.call_id == "cached":
                return ToolResult(output="from cache")
            if c.call.name == "add":
                return await next(c.with_arguments({"a": 100, "b": 1}))
            return await next(c)

        async def retry(c: ToolCall, next: ToolNext) -> ToolResult:
            try:
                return await next(c)
            except RuntimeError:
                return await next(c)

        async def broken(c: ToolCall, next: ToolNext) -> ToolResult:
            if c.call.call_id == "boom":
                raise ValueError("wrapper bug")
            return await next(c)

        script = calls(
            call("add", call_id="args", a=1, b=1),
            call("add", call_id="deny", a=1, b=1),
            call("add", call_id="cached", a=1, b=1),
            call("flaky", call_id="retry", n=7),
            call("add", call_id="boom", a=1, b=1),
        )
        async with Runtime(
            providers={"scripted": ScriptedProvider([script, text("x")])}
        ) as runtime:
            inference_input = request(add, flaky)
            await runtime.wait(
                runtime.run_loop(
                    "agent",
                    "go",
                    inference_input,
                    tool_wrappers=[outer, args_and_cache, retry, broken],
                )
            )
        outputs = {
            i.call_id: i
            for i in inference_input.context.items
            if isinstance(i, FunctionCallOutputItem)
        }
        assert outputs["args"].output == "101!"
        assert (outputs["deny"].output, outputs["deny"].is_error) == (
            "denied: not today",
            True,
        )
        assert outputs["cached"].output == "from cache!"
        assert outputs["retry"].output == "7!"
        assert outputs["boom"].is_error
        assert outputs["boom"].output == "tool 'add' raised ValueError: wrapper bug"
        assert trace[:3] == ["outer>args", "inner>args", "outer<args"]

    async def test_model_wrappers_change_cache_and_retry(self) -> None:
        """Model wrappers can change the request, answer from a cache, and retry."""
        served: list[str] = []
        failures = 1

        def model(req: InferenceInput) -> InferenceOutput:
            nonlocal failures
            if failures:
                failures -= 1
                raise ProviderError("flaky")
            served.append(req.model)
            return text(f"from {req.model}")

        async def swap(req: ModelRequest, next: ModelNext) -> InferenceOutput:
            return await next(
                req.model_copy(
                    update={"input": req.input.model_copy(update={"model": "fn:small"})}
                )
            )

        async def retry_once(req: ModelRequest, next: ModelNext) -> InferenceOutput:
            try:
                return await next(req)
            except ProviderError:
                return await next(req)

        cache: dict[str, InferenceOutput] = {}

        async def cached(req: ModelRequest, next: ModelNext) -> InferenceOutput:
            last = req.input.context.items[-1]
            assert isinstance(last, UserMessage)
            if last.content not in cache:
                cache[last.content] = await next(req)
            return cache[last.content]

        async with Runtime(providers={"fn": FunctionProvider(model)}) as runtime:
            first = await runtime.wait(
                runtime.run_loop(
                    "a",
                    "q",
                    request(model="fn:big"),
                    model_wrappers=[cached, retry_once, swap],
                )
            )
            second = await runtime.wait(
                runtime.run_loop(
                    "a",
                    "q",
                    request(model="fn:big"),
                    model_wrappers=[cached, retry_once, swap],
                )
            )
        assert served == ["fn:small"]
        assert (
            first.answer == second.answer == ModelMessageItem(content="from fn:small")
        )

    async def test_truncated_response_runs_none_of_its_calls(self) -> None:
        """Calls in a response cut by the token limit get error outputs; the loop continues."""
        cut = InferenceOutput(
            items=(FunctionCallItem(call_id="t", name="add", arguments='{"a": 1, "b'),),
            finish_reason="length",
        )
        provider = ScriptedProvider([cut, text("sorry")])
        async with Runtime(providers={"scripted": provider}) as runtime:
            inference_input = request()
            result = await runtime.wait(
                runtime.run_loop("agent", "go", inference_input)
            )
        out = inference_input.context.items[2]
        assert isinstance(out, FunctionCallOutputItem)
        assert out.is_error
        assert "output token limit" in out.output
        assert "truncated" in out.output
        assert result.tool_calls == 0
        assert result.outcome is Outcome.answered


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


class TestContextAndErrors:
    async def test_orphaned_call_repaired_in_the_request_only(self) -> None:
        """A call without an output gets a synthetic one in the request, not in the history."""
        context = ModelContext(
            items=[
                UserMessage(content="earlier"),
                FunctionCallItem(call_id="lost", name="add", arguments="{}"),
                UserMessage(content="now"),
            ]
        )
        seen: list[ModelRequest] = []

        async def spy(req: ModelRequest, next: ModelNext) -> InferenceOutput:
            seen.append(req)
            return await next(req)

        provider = ScriptedProvider([text("ok")])
        async with Runtime(providers={"scripted": provider}) as runtime:
            await runtime.wait(
                runtime.run_loop(
                    "agent",
                    None,
                    InferenceInput(model="scripted:x", context=context),
                    model_wrappers=[spy],
                )
            )
        assert items_of(provider.requests[0].context) == [
            "user:earlier",
            "call:lost",
            "out:lost=ERR",
            "user:now",
        ]
        assert items_of(context) == [
            "user:earlier",
            "call:lost",
            "user:now",
            "model:ok",
        ]
        metadata = seen[0].metadata
        assert metadata.history_count == 3
        assert [(s.kind, s.item_index, s.call_id) for s in metadata.sources] == [
            ("history", 0, None),
            ("history", 1, None),
            ("repair", 1, "lost"),
            ("history", 2, None),
        ]

    async def test_repair_scan_carries_over_between_loops_on_one_context(self) -> None:
        """A second loop on a context finds a call left without output after the first."""
        context = ModelContext()
        provider = ScriptedProvider([text("one")])
        async with Runtime(providers={"scripted": provider}) as rt:
            await rt.wait(
                rt.run_loop(
                    "a", "first", InferenceInput(model="scripted:x", context=context)
                )
            )
            context.append(FunctionCallItem(call_id="lost", name="add", arguments="{}"))
            context.append(UserMessage(content="second"))
            await rt.wait(
                rt.run_loop(
                    "a", None, InferenceInput(model="scripted:x", context=context)
                )
            )
        second = provider.requests[1]
        assert items_of(second.context) == [
            "user:first",
            "model:one",
            "call:lost",
            "out:lost=ERR",
            "user:second",
        ]
        assert "out:lost=ERR" not in items_of(context)

    def test_the_scan_is_kept_with_its_context_and_not_with_copies(self) -> None:
        """The scan lives in a slot of the context: one per context, shared by
        its loops, absent from copies, dumps and equality; contexts stay weakref-able."""
        context = ModelContext(items=[UserMessage(content="hi")])
        scan = context_scan(context)
        assert context_scan(context) is scan
        copy = context.model_copy(deep=True)
        assert context_scan(copy) is not scan
        assert copy == context
        assert context.model_dump() == {
            "instructions": None,
            "items": [{"type": "user_message", "content": "hi"}],
        }
        assert weakref.ref(context)() is context

    async def test_handlers_see_the_request_metadata(self) -> None:
        """An infer transition's pending carries the request's metadata."""
        seen: list[RequestMetadata] = []

        def spy(pending: PendingTransition) -> None:
            if pending.trigger is Trigger.infer:
                assert pending.metadata is not None
                seen.append(pending.metadata)

        context = ModelContext(
            items=[
                FunctionCallItem(call_id="lost", name="add", arguments="{}"),
                UserMessage(content="hi"),
            ]
        )
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("ok")])}
        ) as rt:
            await rt.wait(
                rt.run_loop(
                    "a", None, InferenceInput(model="scripted:x", context=context), spy
                )
            )
        assert [s.kind for s in seen[0].sources] == ["history", "repair", "history"]

    async def test_each_request_has_its_own_metadata(self) -> None:
        """Every request counts the context it was made from."""
        seen: list[RequestMetadata] = []

        def spy(pending: PendingTransition) -> None:
            if pending.trigger is Trigger.infer:
                assert pending.metadata is not None
                seen.append(pending.metadata)

        provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
        async with Runtime(providers={"scripted": provider}) as rt:
            await rt.wait(rt.run_loop("a", "hi", request(add), spy))
        assert [m.history_count for m in seen] == [1, 3]
        assert seen[0] is not seen[1]

    async def test_handlers_and_wrappers_share_one_metadata_of_the_request(
        self,
    ) -> None:
        """The metadata counts the context when the request was made, whatever a
        handler then does to the payload, and every reader gets the same object."""
        seen: list[RequestMetadata] = []

        def grow(pending: PendingTransition) -> Rewrite | None:
            if pending.trigger is not Trigger.infer:
                return None
            assert pending.metadata is not None
            seen.append(pending.metadata)
            request = pending.payload
            assert isinstance(request, InferenceInput)
            bigger = ModelContext(
                items=[*request.context.items, UserMessage(content="more")]
            )
            return Rewrite(payload=request.model_copy(update={"context": bigger}))

        async def spy(req: ModelRequest, next: ModelNext) -> InferenceOutput:
            seen.append(req.metadata)
            return await next(req)

        async with Runtime(
            providers={"scripted": ScriptedProvider([text("ok")])}
        ) as rt:
            await rt.wait(
                rt.run_loop(
                    "a",
                    "hi",
                    InferenceInput(model="scripted:x", context=ModelContext()),
                    grow,
                    model_wrappers=[spy],
                )
            )
        handler_saw, wrapper_saw = seen
        assert handler_saw is wrapper_saw
        assert handler_saw.history_count == 1

    async def test_structured_output_invalid_then_valid(self) -> None:
        """An invalid answer goes back with the error; the valid one is parsed."""

        class Answer(BaseModel):
            city: str
            population: int

        provider = ScriptedProvider(
            [
                text('{"city": "Oslo", "population": "many"}'),
                text('{"city": "Oslo", "population": 709000}'),
            ]
        )
        async with Runtime(providers={"scripted": provider}) as runtime:
            recorder = EventRecorder(runtime.bus, "model.answer")
            inference_input = InferenceInput(
                model="scripted:x", context=ModelContext(), structured_output=Answer
            )
            result = await runtime.wait(
                runtime.run_loop("agent", "biggest city?", inference_input)
            )
        assert result.output == Answer(city="Oslo", population=709000)
        retry = inference_input.context.items[2]
        assert isinstance(retry, UserMessage)
        assert "population" in retry.content
        assert "valid integer" in retry.content
        answers = [e for e in recorder.events if isinstance(e, ModelAnswer)]
        assert len(answers) == 1
        assert answers[0].parsed == {"city": "Oslo", "population": 709000}
        assert_path(
            result,
            "idle context_update inference model_message context_update inference model_message idle",
        )

    async def test_structured_output_fails_after_its_retries(self) -> None:
        """An answer that keeps failing a JSON schema fails the loop with the error."""
        schema = {
            "type": "object",
            "properties": {"n": {"type": "integer"}},
            "required": ["n"],
        }
        provider = ScriptedProvider([text('{"n": "x"}'), text("{}")])
        async with Runtime(providers={"scripted": provider}) as runtime:
            result = await runtime.wait(
                runtime.run_loop(
                    "agent",
                    "n?",
                    InferenceInput(
                        model="scripted:x",
                        context=ModelContext(),
                        structured_output=schema,
                    ),
                    structured_output_retries=1,
                )
            )
        assert result.error is not None
        assert result.error.type == "StructuredOutputError"
        assert "after 2 attempts" in result.error.message
        assert "'n' is a required property" in result.error.message

    async def test_transient_error_then_success(self) -> None:
        """A retryable provider error is retried; a permanent one fails with its message."""
        provider = ScriptedProvider(
            [ProviderError("rate limited", retryable=True), text("ok")]
        )
        permanent = ScriptedProvider([ProviderError("invalid api key")])
        async with Runtime(
            providers={"scripted": provider, "bad": permanent}
        ) as runtime:
            ok = await runtime.wait(
                runtime.run_loop("a", "q", request(), retry_backoff=0)
            )
            failed = await runtime.wait(
                runtime.run_loop("a", "q", request(model="bad:x"), retry_backoff=0)
            )
        assert ok.answer == ModelMessageItem(content="ok")
        assert ok.model_requests == 1
        assert failed.error is not None
        assert (failed.error.type, failed.error.message) == (
            "ProviderError",
            "invalid api key",
        )

    async def test_finish_turn_sees_isolated_snapshots_and_can_fail_the_loop(
        self,
    ) -> None:
        """finish_turn runs after each turn with a copy; if it raises, the loop fails."""
        snapshots: list[TurnSnapshot] = []

        def record(snapshot: TurnSnapshot) -> None:
            snapshots.append(snapshot)

        async def explode(snapshot: TurnSnapshot) -> None:
            raise RuntimeError("checkpoint store down")

        script = [calls(call("add", call_id="c", a=1, b=2)), text("3")]
        async with Runtime(
            providers={
                "scripted": ScriptedProvider(script),
                "again": ScriptedProvider(script),
            }
        ) as runtime:
            inference_input = request()
            ok = await runtime.wait(
                runtime.run_loop("a", "q", inference_input, finish_turn=record)
            )
            failed = await runtime.wait(
                runtime.run_loop(
                    "a", "q", request(model="again:x"), finish_turn=explode
                )
            )
        assert ok.outcome is Outcome.answered
        assert [s.turn for s in snapshots] == [1, 2]
        assert [o.output for o in snapshots[0].tool_outputs] == ["3"]
        assert len(snapshots[0].context) == 3
        assert len(inference_input.context.items) == 4  # the snapshot did not grow
        assert failed.error is not None
        assert (failed.error.type, failed.error.message) == (
            "RuntimeError",
            "checkpoint store down",
        )
        assert_path(failed, "idle context_update inference function_call idle")

    async def test_totals_in_result_and_idle_event(self) -> None:
        """Results and loop.idle carry requests, tool calls and token totals."""
        usage = TokenUsage(input_tokens=10, output_tokens=4, reasoning_tokens=2)
        provider = ScriptedProvider(
            [calls(call("add", a=1, b=1), usage=usage), text("2", usage=usage)]
        )
        async with Runtime(providers={"scripted": provider}) as runtime:
            recorder = EventRecorder(runtime.bus, "loop.idle")
            result = await runtime.wait(runtime.run_loop("a", "q", request()))
        idle = recorder.events[0]
        assert isinstance(idle, LoopIdle)
        expected = TokenUsage(input_tokens=20, output_tokens=8, reasoning_tokens=4)
        assert result.usage == idle.usage == expected
        assert (idle.model_requests, idle.tool_calls) == (2, 1)
        assert result.states[-1] is LoopState.idle


async def test_an_answer_on_the_last_allowed_turn_is_answered() -> None:
    """Reaching max_turns with an answer ends `answered`; a queued follow-up is kept."""
    async with Runtime(providers={"scripted": ScriptedProvider([text("hi")])}) as rt:
        plain = await rt.wait(rt.run_loop("a", "q", request(), max_turns=1))
        loop_id = rt.run_loop("a", "q", request(), max_turns=1)
        rt.follow_up(loop_id, "more")
        queued = await rt.wait(loop_id)
    assert (plain.outcome, plain.answer) == (
        Outcome.answered,
        ModelMessageItem(content="hi"),
    )
    assert (queued.outcome, queued.reason) == (Outcome.stopped, "max_turns")
    assert queued.model_requests == 1
