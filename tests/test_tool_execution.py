"""Tool execution: sequential and parallel batches, progress, terminate, wrappers."""

from __future__ import annotations

import contextvars
from typing import Literal

import anyio
import anyio.lowlevel
import pytest

from agentfsm import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    ModelMessageItem,
    ModelRequest,
    Outcome,
    ProviderError,
    Runtime,
    ToolCall,
    ToolResult,
    Trigger,
    UserMessage,
    report_progress,
    tool,
)
from agentfsm._loop.tool_call import INTERRUPTED
from agentfsm.events import (
    FunctionCallCompleted,
    FunctionCallProgress,
)
from agentfsm.providers import ModelNext
from agentfsm.providers.function import FunctionProvider
from agentfsm.testing import (
    EventRecorder,
    ScriptedProvider,
    call,
    calls,
    text,
)
from agentfsm.tools import ToolNext
from tests.helpers import add, items_of, request, wait_until

_VAR: contextvars.ContextVar[str | None] = contextvars.ContextVar("_VAR", default=None)


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

    async def test_a_parallel_batch_has_a_task_per_slot_taking_calls_in_order(
        self,
    ) -> None:
        """Under the cap, calls start in the model's order as slots free up,
        each slot one task; calls that cannot wait run in the loop's task."""
        started: list[int] = []
        tasks: dict[int, int] = {}
        running = peak = 0

        @tool
        async def waits(n: int) -> int:
            """Waits twice."""
            nonlocal running, peak
            started.append(n)
            tasks[n] = anyio.get_current_task().id
            running += 1
            peak = max(peak, running)
            await anyio.lowlevel.checkpoint()
            await anyio.lowlevel.checkpoint()
            running -= 1
            return n

        @tool
        async def quick(n: int) -> int:
            """Never waits."""
            started.append(n)
            tasks[n] = anyio.get_current_task().id
            return n

        provider = ScriptedProvider(
            [
                calls(*(call("waits", n=i) for i in range(10))),
                calls(*(call("quick", n=i) for i in range(10, 13))),
                text("done"),
            ]
        )
        async with Runtime(providers={"scripted": provider}) as runtime:
            inference_input = request(waits, quick)
            result = await runtime.wait(
                runtime.run_loop(
                    "a",
                    "go",
                    inference_input,
                    tool_execution="parallel",
                    max_tool_concurrency=3,
                )
            )
        assert result.answer is not None
        assert started == list(range(13))
        assert peak == 3
        assert len({tasks[n] for n in range(10)}) == 3  # one task per slot
        assert len({tasks[n] for n in range(10, 13)}) == 1  # the loop's own
        assert tasks[10] not in {tasks[n] for n in range(10)}
        outputs = [
            i.output
            for i in inference_input.context.items
            if isinstance(i, FunctionCallOutputItem)
        ]
        assert outputs == [str(n) for n in range(13)]

    @pytest.mark.parametrize("mode", ["sequential", "parallel"])
    async def test_a_cancel_while_a_call_ends_starts_no_other_call(
        self, mode: Literal["sequential", "parallel"]
    ) -> None:
        """A call that ends normally after `Runtime.cancel` (its work shielded)
        is the batch's last: the calls after it get the interrupted output."""
        ran: list[str] = []
        entered = anyio.Event()

        @tool
        async def save(n: int) -> str:
            """Saves, shielded from cancellation."""
            entered.set()
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.01)
            ran.append(f"save{n}")
            return "saved"

        @tool
        async def charge(n: int) -> str:
            """Charges (never waits)."""
            ran.append(f"charge{n}")
            return "charged"

        provider = ScriptedProvider(
            [
                calls(call("save", n=0), call("charge", n=1), call("charge", n=2)),
                text("done"),
            ]
        )
        async with Runtime(providers={"scripted": provider}) as runtime:
            inference_input = request(save, charge)
            loop_id = runtime.run_loop(
                "a", "go", inference_input, tool_execution=mode, max_tool_concurrency=1
            )
            await entered.wait()
            runtime.cancel(loop_id, "stop")
            result = await runtime.wait(loop_id)
        assert result.outcome is Outcome.cancelled
        assert ran == ["save0"]
        outputs = [
            i.output
            for i in inference_input.context.items
            if isinstance(i, FunctionCallOutputItem)
        ]
        assert outputs == ["saved", INTERRUPTED, INTERRUPTED]

    async def test_each_call_of_a_parallel_batch_has_its_own_context(self) -> None:
        """A `ContextVar` a call sets stays with it, as in a task of its own,
        whether the batch's calls wait or not."""
        seen: list[tuple[int, str | None]] = []

        @tool
        async def quick(n: int) -> str:
            """Never waits."""
            seen.append((n, _VAR.get()))
            _VAR.set(f"call{n}")
            return "ok"

        @tool
        async def waits(n: int) -> str:
            """Waits once."""
            seen.append((n, _VAR.get()))
            _VAR.set(f"call{n}")
            await anyio.lowlevel.checkpoint()
            assert _VAR.get() == f"call{n}"
            return "ok"

        provider = ScriptedProvider(
            [
                calls(call("quick", n=0), call("quick", n=1)),
                calls(*(call("waits", n=n) for n in range(2, 6))),
                text("done"),
            ]
        )
        async with Runtime(providers={"scripted": provider}) as runtime:
            result = await runtime.wait(
                runtime.run_loop(
                    "a",
                    "go",
                    request(quick, waits),
                    tool_execution="parallel",
                    max_tool_concurrency=2,
                )
            )
        assert result.answer is not None
        assert seen == [(n, None) for n in range(6)]
        assert _VAR.get() is None

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
                cache[last.text] = await next(req)
            return cache[last.text]

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
