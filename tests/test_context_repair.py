"""The context: calls without outputs repaired in the request only, and the
request metadata handlers and wrappers see."""

from __future__ import annotations

from agentfsm import (
    FunctionCallItem,
    InferenceInput,
    InferenceOutput,
    ModelContext,
    ModelRequest,
    PendingTransition,
    RequestMetadata,
    Rewrite,
    Runtime,
    Trigger,
    UserMessage,
)
from agentfsm.providers import ModelNext
from agentfsm.testing import (
    ScriptedProvider,
    call,
    calls,
    text,
)
from tests.helpers import add, items_of, request


class TestContextRepair:
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
