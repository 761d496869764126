"""The effects seam: `Runtime(extensions=[...])`.

An extension's layers sit inside the loop's own wrappers (a model request:
the model wrappers, then the provider layers, then the provider; a tool call:
the tool wrappers, then the tool layers, then the tool), its hooks see the
loop through a read-only `LoopInfo`, and what it does not override costs the
loop nothing. A hook that raises never stops a loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from agentfsm import (
    ConfigurationError,
    InferenceInput,
    InferenceOutput,
    LoopStatus,
    ModelRequest,
    Outcome,
    Runtime,
    ToolCall,
    ToolResult,
)
from agentfsm.extensions import Extension, LoopExtension, LoopInfo
from agentfsm.inference import ImageSupport
from agentfsm.providers import ModelNext, Provider, StreamEvent
from agentfsm.store import MemoryStore
from agentfsm.testing import ScriptedProvider, call, calls, text
from agentfsm.tools import ToolNext
from tests.helpers import add, pause_tools, request

pytestmark = pytest.mark.anyio


class Layer(LoopExtension):
    """Records what passes through each of its layers and hooks, in `seen`."""

    def __init__(self, name: str, seen: list[str], info: LoopInfo) -> None:
        self.name, self.seen, self.info = name, seen, info

    def provider(self, provider: Provider, /) -> Provider:
        return _Noted(provider, f"{self.name}:model", self.seen)

    async def call_tool(self, call: ToolCall, next_: ToolNext, /) -> ToolResult:
        self.seen.append(f"{self.name}:tool {call.call.name}")
        return await next_(call)

    def start_run(self, start: Callable[[], None], /) -> None:
        self.seen.append(f"{self.name}:start {self.info.status}")
        start()

    def committed(self) -> None:
        step = self.info.last_step
        assert step is not None
        self.seen.append(f"{self.name}:commit {step.dest}")

    def run_ended(self) -> None:
        self.seen.append(f"{self.name}:run_ended {self.info.status}")

    def loop_ended(self) -> None:
        self.seen.append(f"{self.name}:loop_ended {self.info.outcome}")


class _Noted:
    """A provider that notes each request it passes on."""

    def __init__(self, inner: Provider, note: str, seen: list[str]) -> None:
        self.inner, self.note, self.seen = inner, note, seen

    def image_support(self, model: str) -> ImageSupport:
        from agentfsm.providers import image_support_of

        return image_support_of(self.inner, model)

    async def complete(self, request: InferenceInput, /) -> InferenceOutput:
        self.seen.append(self.note)
        return await self.inner.complete(request)

    def stream(
        self, request: InferenceInput, /
    ) -> AbstractAsyncContextManager[AsyncIterator[StreamEvent]]:
        self.seen.append(self.note + " (streamed)")
        return self.inner.stream(request)


class Recorder(Extension):
    """Takes part in every loop with a `Layer` named `name`."""

    def __init__(self, name: str, seen: list[str]) -> None:
        self.name, self.seen = name, seen
        self.opened: list[LoopInfo] = []

    def open(self, loop: LoopInfo, /) -> LoopExtension | None:
        self.opened.append(loop)
        return Layer(self.name, self.seen, loop)


def script() -> ScriptedProvider:
    return ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])


async def test_layers_sit_inside_the_loops_wrappers_first_outermost() -> None:
    seen: list[str] = []

    async def tool_wrapper(call: ToolCall, next_: ToolNext) -> ToolResult:
        seen.append("wrapper:tool")
        return await next_(call)

    async def model_wrapper(request: ModelRequest, next_: ModelNext) -> Any:
        seen.append("wrapper:model")
        return await next_(request)

    extensions = [Recorder("a", seen), Recorder("b", seen)]
    async with Runtime(providers={"scripted": script()}, extensions=extensions) as rt:
        loop_id = rt.run_loop(
            "agent",
            "hi",
            request(),
            tool_wrappers=[tool_wrapper],
            model_wrappers=[model_wrapper],
        )
        result = await rt.wait(loop_id)
    assert result.outcome is Outcome.answered
    layers = [s for s in seen if ":model" in s or ":tool" in s]
    assert layers == [
        "wrapper:model",
        "a:model",
        "b:model",
        "wrapper:tool",
        "a:tool add",
        "b:tool add",
        "wrapper:model",
        "a:model",
        "b:model",
    ]


async def test_hooks_follow_the_loop_run_by_run() -> None:
    seen: list[str] = []
    async with Runtime(
        providers={"scripted": script()}, extensions=[Recorder("a", seen)]
    ) as rt:
        loop_id = rt.run_loop("agent", "hi", request(), pause_tools)
        while rt.get(loop_id).status is not LoopStatus.paused:
            await anyio.lowlevel.checkpoint()
        await anyio.wait_all_tasks_blocked()
        rt.resume(loop_id)
        result = await rt.wait(loop_id)
    hooks = [
        s.removeprefix("a:") for s in seen if ":model" not in s and ":tool" not in s
    ]
    commits = [h for h in hooks if h.startswith("commit")]
    assert commits == [f"commit {step.dest}" for step in result.path]
    lifecycle = [h for h in hooks if not h.startswith("commit")]
    assert lifecycle == [
        "start running",
        "run_ended paused",
        "start paused",  # a resume starts its run before it applies the decision
        "loop_ended answered",  # in the run: the run returns after
        "run_ended done",
    ]


async def test_only_what_a_part_overrides_is_composed() -> None:
    """A part overriding nothing, and an extension taking no part, leave the
    loop on its direct path: no layer, no hook."""

    class Idle(LoopExtension):
        pass

    class Bystander(Extension):
        def open(self, loop: LoopInfo, /) -> LoopExtension | None:
            return Idle()

    class Absent(Extension):
        pass

    async with Runtime(
        providers={"scripted": script()}, extensions=[Bystander(), Absent()]
    ) as rt:
        loop_id = rt.run_loop("agent", "hi", request(), pause_tools)
        loop = rt._loops[loop_id]
        assert loop.extensions == ()
        assert loop.tool_chain is None
        assert loop.on_commit is None
        assert loop.providers is rt.providers
        rt.cancel(loop_id)
        await rt.wait(loop_id)


async def test_loop_info_reads_the_loop_and_writes_nothing() -> None:
    infos: list[LoopInfo] = []

    class Keep(Extension):
        def open(self, loop: LoopInfo, /) -> None:
            infos.append(loop)

    async with Runtime(providers={"scripted": script()}, extensions=[Keep()]) as rt:
        loop_id = rt.run_loop("tenant/agent", "hi", request(), pause_tools)
        [info] = infos
        assert info.pending_message is not None
        assert info.pending_message.content == "hi"
        assert (info.loop_id, info.agent_id, info.model) == (
            loop_id,
            "tenant/agent",
            "scripted:test",
        )
        while rt.get(loop_id).status is not LoopStatus.paused:
            await anyio.lowlevel.checkpoint()
        assert info.pause_reason == "approval required"
        assert info.view() == rt.get(loop_id)
        assert info.snapshot() == rt.snapshot(loop_id)
        assert info.result() is None
        with pytest.raises(AttributeError):
            info.status = LoopStatus.done  # type: ignore[misc]
        rt.resume(loop_id)
        result = await rt.wait(loop_id)
    assert info.result() == result
    assert info.usage == result.usage
    assert (info.model_requests, info.tool_calls) == (2, 1)


async def test_a_failing_hook_is_logged_and_the_loop_goes_on(
    log_output: list[dict[str, Any]],
) -> None:
    class Broken(LoopExtension):
        def start_run(self, start: Callable[[], None], /) -> None:
            raise RuntimeError("start_run broke")  # before it started the run

        def committed(self) -> None:
            raise RuntimeError("committed broke")

        def run_ended(self) -> None:
            raise RuntimeError("run_ended broke")

        def loop_ended(self) -> None:
            raise RuntimeError("loop_ended broke")

    class Breaks(Extension):
        def open(self, loop: LoopInfo, /) -> LoopExtension:
            return Broken()

    seen: list[str] = []
    async with Runtime(
        providers={"scripted": script()}, extensions=[Breaks(), Recorder("b", seen)]
    ) as rt:
        result = await rt.wait(rt.run_loop("agent", "hi", request()))
    assert result.outcome is Outcome.answered
    failed = {e["hook"] for e in log_output if e["event"] == "extension_hook_failed"}
    assert failed == {"start_run", "committed", "run_ended", "loop_ended"}
    # The other extension's hooks ran all the same, the run started once.
    assert seen.count("b:start running") == 1
    assert "b:loop_ended answered" in seen


async def test_a_start_run_that_never_starts_the_run_cannot_hold_the_loop(
    log_output: list[dict[str, Any]],
) -> None:
    class Forgetful(LoopExtension):
        def start_run(self, start: Callable[[], None], /) -> None:
            pass

    class Forgets(Extension):
        def open(self, loop: LoopInfo, /) -> LoopExtension:
            return Forgetful()

    async with Runtime(providers={"scripted": script()}, extensions=[Forgets()]) as rt:
        result = await rt.wait(rt.run_loop("agent", "hi", request()))
    assert result.outcome is Outcome.answered
    assert any(e["event"] == "extension_skipped_start" for e in log_output)


async def test_a_bad_open_fails_run_loop_before_anything_is_kept() -> None:
    class Wrong(Extension):
        def open(self, loop: LoopInfo, /) -> Any:
            return "a part"

    class Raising(Extension):
        def open(self, loop: LoopInfo, /) -> LoopExtension | None:
            raise KeyError("tenant")

    store = MemoryStore()
    for extension, message in (
        (Wrong(), r"Wrong\.open must return a LoopExtension or None, got str"),
        (Raising(), r"extension .*Raising could not open loop .*KeyError"),
    ):
        async with Runtime(
            providers={"scripted": script()}, extensions=[extension], store=store
        ) as rt:
            with pytest.raises(ConfigurationError, match=message):
                rt.run_loop("agent", "hi", request())
            assert rt.loops() == []
    assert await store.loops() == []


async def test_extensions_take_part_in_loops_recovered_from_a_store() -> None:
    store = MemoryStore()
    async with Runtime(providers={"scripted": script()}, store=store) as first:
        loop_id = first.run_loop("agent", "hi", request(), pause_tools)
        while first.get(loop_id).status is not LoopStatus.paused:
            await anyio.lowlevel.checkpoint()
    seen: list[str] = []
    recorder = Recorder("r", seen)
    async with Runtime(
        providers={"scripted": ScriptedProvider([text("3")])},  # the rest of it
        store=store,
        extensions=[recorder],
        tools=[add],
        handlers=[pause_tools],
    ) as second:
        await second.recover()
        assert [info.loop_id for info in recorder.opened] == [loop_id]
        second.resume(loop_id)
        result = await second.wait(loop_id)
    assert result.outcome is Outcome.answered
    assert "r:tool add" in seen
    assert seen[-2:] == ["r:loop_ended answered", "r:run_ended done"]


async def test_instrument_is_one_more_extension() -> None:
    """`Runtime(instrument=x)`, the older spelling, is `extensions=[..., x]`."""
    seen: list[str] = []
    async with Runtime(
        providers={"scripted": script()},
        extensions=[Recorder("a", seen)],
        instrument=Recorder("b", seen),
    ) as rt:
        await rt.wait(rt.run_loop("agent", "hi", request()))
    assert [s for s in seen if s.endswith(":tool add")] == ["a:tool add", "b:tool add"]


async def test_an_error_of_the_runtime_starting_a_run_reaches_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the runtime's own start raises is not a hook's failure: with or
    without a `start_run` around it, the caller sees it."""
    from agentfsm._runtime.workers import WorkerPool

    def refuse(self: WorkerPool, loop: object) -> None:
        raise RuntimeError("no worker")

    for extensions in ([], [Recorder("a", [])]):
        async with Runtime(
            providers={"scripted": script()}, extensions=extensions
        ) as rt:
            with monkeypatch.context() as patched:
                patched.setattr(WorkerPool, "run", refuse)
                with pytest.raises(RuntimeError, match="no worker"):
                    rt.run_loop("agent", "hi", request())
            rt.cancel(rt.loops()[0])
