"""agentfsm: an explicit finite-state-machine runtime for LLM agent loops."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

from ._bus import BusStatistics as BusStatistics
from ._bus import EventBus as EventBus
from ._bus import Subscription as Subscription
from ._bus import SubscriptionStatistics as SubscriptionStatistics
from ._loop import current_loop_id as current_loop_id
from ._runtime import Runtime as Runtime
from ._runtime import current_runtime as current_runtime
from ._runtime import run_loop as run_loop
from .agent import Agent as Agent
from .agent import Conversation as Conversation
from .breakpoints import Break as Break
from .exceptions import AgentFSMError as AgentFSMError
from .exceptions import ConfigurationError as ConfigurationError
from .exceptions import ImageMissing as ImageMissing
from .exceptions import ImageNotSupported as ImageNotSupported
from .exceptions import LoopAborted as LoopAborted
from .exceptions import LoopFailedError as LoopFailedError
from .exceptions import NoRuntimeError as NoRuntimeError
from .exceptions import ProviderError as ProviderError
from .exceptions import ToolCancelled as ToolCancelled
from .exceptions import ToolError as ToolError
from .exceptions import TransitionRejected as TransitionRejected
from .inference import ImageSupport as ImageSupport
from .inference import InferenceInput as InferenceInput
from .inference import InferenceOutput as InferenceOutput
from .inference import ModelRequest as ModelRequest
from .inference import ModelSettings as ModelSettings
from .inference import RequestMetadata as RequestMetadata
from .interception import Abort as Abort
from .interception import Decision as Decision
from .interception import InterceptionHandler as InterceptionHandler
from .interception import Pause as Pause
from .interception import PendingTransition as PendingTransition
from .interception import Proceed as Proceed
from .interception import Rewrite as Rewrite
from .interception import ToolBatch as ToolBatch
from .messages import FunctionCallItem as FunctionCallItem
from .messages import FunctionCallOutputItem as FunctionCallOutputItem
from .messages import ImageBlock as ImageBlock
from .messages import ModelContext as ModelContext
from .messages import ModelMessageItem as ModelMessageItem
from .messages import ReasoningItem as ReasoningItem
from .messages import TextBlock as TextBlock
from .messages import TokenUsage as TokenUsage
from .messages import UserMessage as UserMessage
from .options import DEFAULT_MAX_TURNS as DEFAULT_MAX_TURNS
from .options import MAX_TURNS_CAP as MAX_TURNS_CAP
from .options import LoopOptions as LoopOptions
from .options import TurnSnapshot as TurnSnapshot
from .options import after_turns as after_turns
from .options import tool_called as tool_called
from .providers import Provider as Provider
from .providers import ProviderRegistry as ProviderRegistry
from .providers.function import FunctionProvider as FunctionProvider
from .reconcile import Reconciled as Reconciled
from .results import LoopResult as LoopResult
from .results import LoopStatus as LoopStatus
from .results import LoopView as LoopView
from .results import PathStep as PathStep
from .states import LoopState as LoopState
from .states import Outcome as Outcome
from .states import Trigger as Trigger
from .tools import Tool as Tool
from .tools import ToolCall as ToolCall
from .tools import ToolCallContext as ToolCallContext
from .tools import ToolResult as ToolResult
from .tools import current_call as current_call
from .tools import report_progress as report_progress
from .tools import tool as tool

if TYPE_CHECKING:
    from .events import AgentEvent as AgentEvent
    from .events import AgentEventAdapter as AgentEventAdapter
    from .record import LoopRecord as LoopRecord

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The event classes are imported on first use (a subscription imports them
    # too): a program that runs loops without watching their events never needs
    # them, and they are the largest part of `import agentfsm`.
    if name in _LAZY:
        events = importlib.import_module(f"{__name__}.events")
        return events if name == "events" else getattr(events, name)
    if name == "LoopRecord":  # what Runtime.snapshot returns; few programs ask
        return importlib.import_module(f"{__name__}.record").LoopRecord
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, "LoopRecord"})


_LAZY: Final = ("AgentEvent", "AgentEventAdapter", "events")


__all__ = (
    # agents
    "Agent",
    "Conversation",
    "ModelSettings",
    # runtime
    "Runtime",
    "run_loop",
    "current_runtime",
    "current_loop_id",
    "DEFAULT_MAX_TURNS",
    "MAX_TURNS_CAP",
    "LoopResult",
    "LoopView",
    "LoopStatus",
    "LoopRecord",
    "PathStep",
    "LoopOptions",
    "TurnSnapshot",
    "after_turns",
    "tool_called",
    # machine
    "LoopState",
    "Trigger",
    "Outcome",
    # interception
    "PendingTransition",
    "Decision",
    "Proceed",
    "Rewrite",
    "Pause",
    "Abort",
    "ToolBatch",
    "InterceptionHandler",
    "Break",
    # items
    "ModelContext",
    "UserMessage",
    "TextBlock",
    "ImageBlock",
    "ModelMessageItem",
    "ReasoningItem",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "TokenUsage",
    # providers and tools
    "InferenceInput",
    "ImageSupport",
    "InferenceOutput",
    "Provider",
    "ProviderRegistry",
    "FunctionProvider",
    "Tool",
    "tool",
    "ToolCall",
    "ToolCallContext",
    "ToolResult",
    "Reconciled",
    "current_call",
    "report_progress",
    "ModelRequest",
    "RequestMetadata",
    # events and bus
    "AgentEvent",
    "AgentEventAdapter",
    "EventBus",
    "Subscription",
    "BusStatistics",
    "SubscriptionStatistics",
    # errors
    "AgentFSMError",
    "ConfigurationError",
    "ImageMissing",
    "ImageNotSupported",
    "NoRuntimeError",
    "TransitionRejected",
    "LoopAborted",
    "LoopFailedError",
    "ToolError",
    "ToolCancelled",
    "ProviderError",
)
