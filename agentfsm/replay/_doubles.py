"""What a replay runs with instead of the model and the tools: the recording.

- `ReplayProvider` serves the n-th recorded `inference.completed` output to the
  n-th request (streamed: the recorded chunks, then the output), for whatever
  model the request names (`providers.OneProviderRegistry` serves every
  model from it).
- `RecordedTool` is a tool with the recorded tool's spec (or the given tool's)
  whose calls return the recorded outputs (their images too, the recorded
  bytes): the first unused output of a call of
  that tool with the same call id and arguments, else with the same arguments,
  else with the same call id (a call with other arguments: a handler changed
  them); after reporting the progress that call reported.
  Its function never runs: no side effects.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from agentfsm.events import ToolSpec
from agentfsm.exceptions import ProviderError, ToolError
from agentfsm.inference import InferenceInput, InferenceOutput, OutputCompleted
from agentfsm.tools import (
    Tool,
    ToolDefinition,
    ToolResult,
    report_progress,
    running_call,
)

if TYPE_CHECKING:
    from agentfsm.inference import StreamEvent

    from .recording import Invocation, Recording

__all__ = ("RecordedTool", "ReplayProvider", "recorded_tools")

_errors: dict[str, type[ProviderError]] = {}


def _error_class(name: str) -> type[ProviderError]:
    """A `ProviderError` named as the recorded error was, so the replayed
    `loop.failed` names the same type."""
    if name == "ProviderError":
        return ProviderError
    cls = _errors.get(name)
    if cls is None:
        cls = _errors[name] = type(name, (ProviderError,), {})
    return cls


class ReplayProvider:
    """Serves a recording's model outputs by request number."""

    def __init__(self, recording: Recording) -> None:
        self._recording = recording
        self.served = 0
        """How many requests it has answered."""
        self.requests: list[InferenceInput] = []
        """The requests the replayed loop made, in order."""

    def _next(self, request: InferenceInput) -> tuple[int, InferenceOutput]:
        self.requests.append(request)
        number, self.served = self.served, self.served + 1
        requests = self._recording.requests
        output = requests[number].output if number < len(requests) else None
        if output is not None:
            return number, output
        failed = self._recording.failed
        if number == len(requests) - 1 and failed is not None:
            # The recorded request failed: it fails again, the same way.
            raise _error_class(failed.error_type)(failed.message)
        raise ProviderError(
            f"replay: the recording has no output for model request {number + 1} "
            f"(it made {sum(r.output is not None for r in requests)})"
        )

    async def complete(self, request: InferenceInput, /) -> InferenceOutput:
        """The recorded output of this request."""
        return self._next(request)[1]

    @asynccontextmanager
    async def stream(
        self, request: InferenceInput, /
    ) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        """The recorded chunks of this request, then its output."""
        number, output = self._next(request)
        deltas = self._recording.requests[number].deltas
        yield _deltas([*deltas, OutputCompleted(output=output)])


async def _deltas(events: list[Any]) -> AsyncIterator[StreamEvent]:
    for event in events:
        yield event


class RecordedTool(Tool):
    """A tool whose calls return recorded outputs (its function never runs)."""

    __slots__ = ("_approvals", "_invocations", "_rule")

    def __init__(
        self,
        spec: ToolSpec,
        invocations: list[Invocation],
        approvals: set[tuple[str, str]],
        like: Tool | None = None,
    ) -> None:
        # There is no function to read a schema from: the definition is the
        # spec's (or the given tool's), and so is the validation.
        # A rule (a function of the arguments) is not data: the recording
        # says which calls it held for approval.
        self._rule = like is None and spec.needs_approval == "rule"
        if like is None:
            super().__init__(
                _never,
                definition=ToolDefinition(
                    name=spec.name,
                    description=spec.description,
                    parameters=spec.parameters,
                ),
                timeout=spec.timeout,
                needs_approval=_recorded_rule
                if self._rule
                else bool(spec.needs_approval),
                execution_mode=spec.execution_mode,
            )
        else:
            super().__init__(
                _never,
                definition=like.definition,
                validate=like.validate_arguments,  # its rule validates arguments
                timeout=like.timeout,
                needs_approval=like.needs_approval,
                execution_mode=like.execution_mode,
                on_crash=like.on_crash,
            )
        self._invocations = invocations
        self._approvals = approvals

    def requires_approval(self, arguments: str | Mapping[str, Any]) -> bool:
        """As recorded for a rule (a function of the arguments, not data)."""
        if self._rule:
            return (self.name, _text(arguments)) in self._approvals
        return super().requires_approval(arguments)

    async def invoke(self, arguments: str | Mapping[str, Any]) -> ToolResult:
        """The recorded output of this call (matched by call id, then by
        arguments), its progress reported again."""
        text = _text(arguments)
        running = running_call()
        call_id = running.call_id if running is not None else None
        unused = [i for i in self._invocations if not i.used]
        # By call id first: the calls of a parallel batch may start in another
        # order than recorded, and two with the same arguments may have had
        # different outputs. Never another call's output by position: which
        # call of a batch starts first is the scheduler's choice.
        match = (
            next(
                (i for i in unused if (i.call_id, i.arguments) == (call_id, text)), None
            )
            or next((i for i in unused if i.arguments == text), None)
            or next((i for i in unused if i.call_id == call_id), None)
        )
        if match is None:
            raise ToolError(
                f"replay: the recording has no more calls of tool {self.name!r} "
                f"with call id {call_id!r} or arguments {text}",
                tool=self.name,
            )
        match.used = True
        for progress in match.progress:
            report_progress(progress)
        return ToolResult(
            output=match.output,
            is_error=match.is_error,
            terminate=match.terminate,
            images=match.images,
        )


def _recorded_rule(arguments: dict[str, Any]) -> bool:
    """Stands for a recorded approval rule (`RecordedTool.requires_approval`
    answers from the recording instead)."""
    raise AssertionError("a recorded rule is never called")


async def _never(**kwargs: Any) -> Any:
    raise AssertionError("a recorded tool's function never runs")


def _text(arguments: str | Mapping[str, Any]) -> str:
    from agentfsm._text import json_text

    return json_text(arguments)


def recorded_tools(recording: Recording, given: Mapping[str, Tool]) -> dict[str, Tool]:
    """A `RecordedTool` for each tool the recorded request offered (with the
    given tool's spec where one of its name is given)."""
    request = recording.started.request
    assert request is not None
    return {
        spec.name: RecordedTool(
            spec,
            recording.invocations.get(spec.name, []),
            recording.approvals,
            given.get(spec.name),
        )
        for spec in request.tools
    }
