"""A fork asked through the decision inbox (`LoopRequest.kind == "fork"`,
from `agentfsm ui` say), applied by a runtime that watches the store.

Any watching runtime may apply one, not only the source loop's holder (an
ended loop has none): one that has the recording's tools, handlers and
callables (`Runtime(tools=, handlers=)`, and those its own loops named) and
a provider for the model. One that lacks any leaves the request pending for
another; a request that can never work (no model request at or after its
seq, a store that keeps no events, a replay that diverges before the fork
point) is refused with a note.

Exactly once: the new loop's id is `fork_id(request)`, derived from the
request, so two runtimes applying it both name the loop the same; the store
takes the first commit of one only (`LoopIdTakenError` for the other, whose
loop fails at that commit: a named loop waits for it before its first model
request, so it asked no model and ran no tool), and that first commit marks
the request applied
in its transaction (the journal carries its id, `Durable.carry`, set before
the loop runs). A runtime that finds the fork's loop in the store already
(the request read pending before it was applied) starts nothing.

The replay up to the fork point runs in the watcher's read of the store: the
requests after it wait for it (a replay answers every model request and tool
call from the recording, so it takes about what the loop's own code did).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from agentfsm._bus.started import rebound
from agentfsm._durable.requests import Refused
from agentfsm.exceptions import ConfigurationError
from agentfsm.interception import APPROVAL_GATE
from agentfsm.store import EventArchive

from .recording import Recording

if TYPE_CHECKING:
    from collections.abc import Mapping

    from agentfsm._durable.keeper import Keeper
    from agentfsm._durable.writer import Durable
    from agentfsm._runtime.runtime import Runtime
    from agentfsm.events import AgentEvent
    from agentfsm.store import LoopRequest, LoopStore

__all__ = ("Bound", "apply_fork", "bound", "fork_id")

_NAMESPACE: Final = uuid.UUID("6f1c2a53-8d0e-5b7a-9c41-2e6a1f0d9b37")
"""The namespace of forks' ids (`fork_id`): a constant, so every process
derives the same id from the same request."""

_CALLABLE_OPTIONS: Final = ("stop_when", "tool_wrappers", "model_wrappers")


def fork_id(request_id: int, loop_id: str) -> str:
    """The id of the loop a fork request starts: a UUIDv5 of the request's id
    and its source loop's (the same in every process)."""
    return str(uuid.uuid5(_NAMESPACE, f"agentfsm-fork:{request_id}:{loop_id}"))


@dataclass(frozen=True, slots=True)
class Bound:
    """What a recording names, bound to a runtime's callables by name."""

    handlers: list[Any]
    options: dict[str, Any] = field(default_factory=dict)
    structured_output: Any = None


def bound(recording: Recording, callables: Mapping[str, Any]) -> Bound:
    """The recording's handlers, callable options and structured-output class
    looked up in `callables` (a runtime's `Bindings.callables`).

    Raises:
        ConfigurationError: one is not there (the message names it).
    """
    started = recording.started
    recorded = [h for h in started.handlers if h != APPROVAL_GATE]
    handlers = rebound(recorded, callables, "handlers")
    options: dict[str, Any] = {}
    record = started.options
    if record is not None:
        for name in _CALLABLE_OPTIONS:
            names = getattr(record, name)
            if names:
                options[name] = rebound(list(names), callables, name)
        if record.finish_turn is not None:
            (options["finish_turn"],) = rebound(
                [record.finish_turn], callables, "finish_turn"
            )
    schema = None
    request = started.request
    if request is not None and isinstance(request.structured_output, str):
        (schema,) = rebound([request.structured_output], callables, "classes")
    return Bound(handlers, options, schema)


async def apply_fork(
    runtime: Runtime, keeper: Keeper, store: LoopStore, request: LoopRequest
) -> tuple[str, Durable] | None:
    """Start the fork `request` asks for in `runtime`, its id carried by the
    new loop's journal (see the module).

    Returns:
        The new loop's id and journal; None: not this runtime's to apply (it
        lacks a tool, a callable or the model's provider), or applied
        already (the runtime or the store has the fork's loop).

    Raises:
        Refused: the request can never work (its note says why).
    """
    from agentfsm._runtime.runtime import knows
    from agentfsm.replay import _prepare_fork

    new_id = fork_id(request.id, request.loop_id)
    if knows(runtime, new_id) or await store.load(new_id) is not None:
        return None  # applied here or elsewhere already (its first commit marks it)
    events = await _events(store, request.loop_id)
    try:
        recording = Recording.of(events)
        _fork_point_exists(recording, request.seq or 0)
    except ConfigurationError as exc:
        raise Refused(str(exc)) from None
    started = recording.started
    assert started.request is not None
    bindings = keeper.bindings
    if any(spec.name not in bindings.tools for spec in started.request.tools):
        return None  # another runtime may have the tools
    try:
        names = bound(recording, bindings.callables)
        runtime.providers.resolve(request.model or started.request.model)
    except ConfigurationError:
        return None  # another runtime may have them
    tools = [bindings.tools[spec.name] for spec in started.request.tools]
    try:
        prepared = await _prepare_fork(
            events,
            request.seq or 0,
            model=request.model,
            tools=tools,
            handlers=names.handlers,
            options=names.options,  # type: ignore[arg-type]
            structured_output=names.structured_output,
        )
    except ConfigurationError as exc:
        raise Refused(str(exc)) from None
    try:
        loop_id = prepared.start(runtime, new_id)
    except ConfigurationError:
        return None  # started here meanwhile
    # Before the loop runs (nothing awaited since `start`): its first commit
    # carries the request.
    durable = keeper.held[loop_id]
    durable.carry(request.id)
    return loop_id, durable


async def _events(store: LoopStore, loop_id: str) -> list[AgentEvent]:
    """The source loop's events (a fork replays them).

    Raises:
        Refused: the store keeps none of them.
    """
    if not isinstance(store, EventArchive) or not getattr(store, "keeps_events", True):
        raise Refused(
            f"the store keeps no events of loop {loop_id}, and a fork replays "
            "them (a store made with events=True keeps them)"
        )
    try:
        return list(await store.loop_events(loop_id))
    except ConfigurationError as exc:
        raise Refused(str(exc)) from None


def _fork_point_exists(recording: Recording, seq: int) -> None:
    """Raises ConfigurationError: the loop made no model request at or after
    `seq` (the fork's replay would find none)."""
    from agentfsm.replay import _fork_point

    _fork_point(recording, seq)
