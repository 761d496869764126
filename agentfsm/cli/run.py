"""`agentfsm run`: run one agent loop on a real model and watch it happen.

```text
agentfsm run "What is 2 + 3?" --tool agentfsm.demo_tools:add --tool-choice add
agentfsm run "What is 2 + 3?" --mcp "python examples/mcp_calc_server.py"
```

The answer streams to the terminal as it comes; each transition and tool call
is shown as it happens (from the event bus), progress while a local model
loads, and at the end the path the loop took and the tokens it used. The exit
code is 0 when the loop answered, 1 when it ended any other way (the outcome
and the error are printed) and 2 for a bad command line (an unknown model or
tool, a missing extra).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import anyio
import structlog
from pydantic import ValidationError

from agentfsm import (
    AgentEvent,
    AgentFSMError,
    InferenceInput,
    LoopResult,
    ModelContext,
    Runtime,
    TokenUsage,
    Tool,
)
from agentfsm._text import printable, printable_log
from agentfsm.events import (
    FunctionCallCompleted,
    FunctionCallStarted,
    InferenceCompleted,
    InferenceStream,
    LoopFailed,
    LoopIdle,
    LoopTransition,
    ModelAnswer,
)
from agentfsm.exceptions import ConfigurationError, ProviderError
from agentfsm.providers import (
    Provider,
    TextDelta,
    split_model,
)
from agentfsm.providers._common import TOOL_CHOICE_MODES
from agentfsm.providers.local import DEFAULT_MODEL, LoadProgress, LocalProvider
from agentfsm.states import Outcome
from agentfsm.tools import format_validation_error

__all__ = ("add_parser", "load_tool", "run", "with_mcp_tools")

DEFAULT_INSTRUCTIONS = (
    "You are a helpful assistant. Answer with the results of the tools you call."
)


def add_parser(commands: Any) -> None:
    """Register `run` and its arguments."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "run",
        help="run one agent loop on a model and stream its answer",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("question", help="the user message the loop starts with")
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"provider:model (default: {DEFAULT_MODEL}, the embedded local model)",
    )
    parser.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stream the answer as it is generated (default: on)",
    )
    parser.add_argument(
        "--tool",
        action="append",
        default=[],
        metavar="MODULE:FUNCTION",
        help="offer a tool (a Tool or a typed function); repeatable",
    )
    parser.add_argument(
        "--mcp",
        action="append",
        default=[],
        metavar="SERVER",
        help="offer the tools of an MCP server: a command run over stdio "
        "('python server.py') or a streamable-HTTP URL; repeatable (needs "
        "agentfsm[mcp])",
    )
    parser.add_argument(
        "--tool-choice",
        metavar="auto|required|none|NAME",
        help="auto (the default), none, or force any tool (required) or the "
        "tool NAME until a tool has answered",
    )
    parser.add_argument(
        "--then-tool-choice",
        choices=("none", "auto"),
        default="none",
        help="the tool choice once a forced tool has answered (default: none, "
        "so the model answers)",
    )
    parser.add_argument(
        "--instructions",
        default=DEFAULT_INSTRUCTIONS,
        help=f"the system prompt (default: {DEFAULT_INSTRUCTIONS!r})",
    )
    parser.add_argument(
        "--max-turns", type=int, default=8, help="most model requests (default: 8)"
    )
    parser.add_argument(
        "--max-output-tokens",
        type=int,
        default=256,
        help="most tokens per model request (default: 256)",
    )
    parser.add_argument(
        "--base-url",
        metavar="URL",
        help="the API's address, for openai:, openai-chat: (any OpenAI-compatible "
        "server) and anthropic: models (default: OPENAI_BASE_URL / ANTHROPIC_BASE_URL)",
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help="the API key (default: OPENAI_API_KEY / ANTHROPIC_API_KEY); prefer the "
        "environment variable, which other users cannot see in the process list",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        help="sampling temperature (default: the provider's; 0.2 for local models)",
    )
    parser.add_argument(
        "--events",
        metavar="FILE.jsonl",
        help="append every event to a JSON-lines file (see `agentfsm inspect`)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Run the loop; returns the exit code."""
    try:
        tools = [load_tool(spec) for spec in args.tool]
        # Checked now, before any server starts; with MCP servers, the tools
        # are known (and `--tool-choice NAME` checked) once they are connected.
        request = _request(args, tools, check_choice=not args.mcp)
    except ConfigurationError as exc:
        return _error(f"error: {exc}", 2)
    # The library logs through structlog and never configures it; the terminal
    # is for the loop's own output, so only warnings are logged (to stderr).
    # The previous configuration comes back after: `main` may run in process.
    saved = structlog.get_config()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        processors=[printable_log, *saved["processors"]],
    )
    display = _Display(sys.stdout)
    try:
        return anyio.run(_run, args, request, display)
    except KeyboardInterrupt:
        display.interrupted()
        return _error("interrupted", 130)
    finally:
        structlog.configure(**saved)


def load_tool(spec: str) -> Tool:
    """The tool named by `module:function` (a `Tool`, or a typed function to wrap).

    Raises:
        ConfigurationError: the module or the attribute does not exist.
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigurationError(f"--tool {spec!r} must be 'module:function'")
    # `agentfsm` is a console script: its sys.path starts with the script's
    # directory, not the current one, where `--tool mytools:fn` means mytools.py
    # (as `python -m` would find it).
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"--tool {spec!r}: cannot import: {exc}") from exc
    found = getattr(module, attribute, None)
    if isinstance(found, Tool):
        return found
    if not callable(found):
        raise ConfigurationError(f"--tool {spec!r}: {module_name} has no {attribute!r}")
    return Tool.from_function(found)


def _request(
    args: argparse.Namespace, tools: Sequence[Tool], *, check_choice: bool = True
) -> InferenceInput:
    split_model(args.model)  # a name without a prefix fails here, clearly
    if args.max_turns < 1 or args.max_output_tokens < 1:
        raise ConfigurationError("--max-turns and --max-output-tokens must be >= 1")
    remote = args.base_url is not None or args.api_key is not None
    if remote and split_model(args.model)[0] not in (
        "openai",
        "openai-chat",
        "anthropic",
    ):
        raise ConfigurationError(
            "--base-url and --api-key apply to openai:, openai-chat: and "
            f"anthropic: models, not {args.model!r}"
        )
    if args.temperature is not None and not 0 <= args.temperature <= 2:
        raise ConfigurationError(
            f"--temperature must be in 0..2, got {args.temperature}"
        )
    choice = args.tool_choice
    request = InferenceInput(
        model=args.model,
        context=ModelContext(instructions=args.instructions),
        tools=tuple(tools),
        tool_choice=choice,
        # Forced until a tool answered: forced on every turn, the loop would
        # never get its answer.
        reset_tool_choice=args.then_tool_choice,
        streaming=args.stream,
        max_output_tokens=args.max_output_tokens,
        temperature=args.temperature,
    )
    named = choice is not None and choice not in TOOL_CHOICE_MODES
    if check_choice and named and request.tool_named(choice) is None:
        offered = ", ".join(t.name for t in tools) or "none (use --tool)"
        raise ConfigurationError(
            f"--tool-choice {choice!r} names no tool offered (offered: {offered})"
        )
    return request


def _error(message: str, code: int) -> int:
    # Errors quote what a model, a tool or a server said.
    print(printable(message), file=sys.stderr)
    return code


async def _run(
    args: argparse.Namespace, request: InferenceInput, display: _Display
) -> int:
    providers: dict[str, Provider] = {}
    try:
        prefix = split_model(request.model)[0]
        if prefix == "local":
            providers["local"] = await _load_local(request.model)
        elif args.base_url is not None or args.api_key is not None:
            providers[prefix] = _remote(prefix, args.base_url, args.api_key)
        async with Runtime(providers=providers, event_log=args.events) as runtime:
            request = await with_mcp_tools(runtime, args, request)
            result = await _watch(runtime, args, request, sys.stdout, display)
    except (ConfigurationError, ProviderError) as exc:
        return _error(f"error: {exc}", 2)
    except OSError as exc:  # e.g. the --events file cannot be opened
        where = f" ({exc.filename})" if exc.filename else ""
        return _error(f"error: {exc.strerror or exc}{where}", 1)
    except AgentFSMError as exc:
        return _error(f"error: {exc}", 1)
    return _summary(result)


async def with_mcp_tools(
    runtime: Runtime, args: argparse.Namespace, request: InferenceInput
) -> InferenceInput:
    """`request` offering the tools of the `--mcp` servers too (each connected
    for the runtime's lifetime).

    Raises:
        ConfigurationError: the `mcp` extra is missing, a server could not be
            started or reached, two tools share a name, or `--tool-choice`
            names no tool offered.
    """
    if not args.mcp:
        return request
    try:
        from agentfsm.mcp import MCPConnectionError, mcp_tools
    except ImportError as exc:
        raise ConfigurationError(f"--mcp: {exc}") from None
    tools = list(request.tools)
    for server in args.mcp:
        try:
            tools.extend(await mcp_tools(server, runtime=runtime))
        except MCPConnectionError as exc:
            # `exc` names the server by its label: its command line or URL
            # may hold a token.
            raise ConfigurationError(f"--mcp: {exc}") from exc
    try:
        return _request(args, tools)
    except ValidationError as exc:  # two servers' tools of one name, say
        raise ConfigurationError(f"--mcp: {format_validation_error(exc)}") from None


def _remote(prefix: str, base_url: str | None, api_key: str | None) -> Provider:
    """The provider of a built-in remote prefix, with `--base-url`/`--api-key`."""
    if prefix in ("openai", "openai-chat"):
        from agentfsm.providers.openai import (
            OpenAIChatProvider,
            OpenAIResponsesProvider,
        )

        kind = (
            OpenAIChatProvider if prefix == "openai-chat" else OpenAIResponsesProvider
        )
        return kind(base_url=base_url, api_key=api_key)
    if prefix == "anthropic":
        from agentfsm.providers.anthropic import AnthropicProvider

        return AnthropicProvider(base_url=base_url, api_key=api_key)
    raise AssertionError(prefix)  # `_request` let no other prefix through


async def _load_local(model: str) -> LocalProvider:
    """A local provider with `model` loaded, showing progress meanwhile."""
    loading = _LoadDisplay(sys.stderr, live=sys.stderr.isatty())
    local = LocalProvider(on_progress=loading)
    if not loading.live:
        await local.load(model)
        return local
    failure: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(loading.tick)
        try:
            await local.load(model)
        except Exception as exc:  # noqa: BLE001 - re-raised below, unwrapped
            failure = exc
        tg.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return local


async def _watch(
    runtime: Runtime,
    args: argparse.Namespace,
    request: InferenceInput,
    out: TextIO,
    display: _Display | None = None,
) -> LoopResult:
    display = _Display(out) if display is None else display
    # Subscribe before the loop starts so no event is missed; backpressure, so
    # every chunk is shown however fast the model streams.
    with runtime.bus.subscribe("*", backpressure=True) as events:
        loop_id = runtime.run_loop(
            "cli",
            args.question,
            request,
            max_turns=args.max_turns,
        )
        async for event in events:
            display.show(event)
            if isinstance(event, LoopIdle):
                break
    return await runtime.wait(loop_id)


def _summary(result: LoopResult) -> int:
    print(f"\npath: {' -> '.join(result.states)}")
    usage = result.usage
    print(
        f"tokens: {usage.input_tokens} in + {usage.output_tokens} out = "
        f"{usage.total_tokens} total, over {result.model_requests} model request(s) "
        f"and {result.tool_calls} tool call(s)"
    )
    print(f"outcome: {result.outcome}")
    if result.outcome is Outcome.answered:
        return 0
    detail = f"{result.error.type}: {result.error.message}" if result.error else None
    return _error(f"loop {result.outcome}: {detail or result.reason or 'no answer'}", 1)


class _Display:
    """Shows a loop's events as they come: transitions, tool calls, streamed text."""

    __slots__ = ("_out", "_states", "_streamed", "_text_open", "_tools", "_usage")

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._text_open = False  # a line of streamed text is being written
        self._streamed = False  # the current answer arrived as chunks
        # What the loop did so far, for the summary of an interrupted run.
        self._states: list[str] = ["idle"]
        self._usage = TokenUsage()
        self._tools = 0

    def interrupted(self) -> None:
        """End the line being written and tell how far the loop got."""
        if self._text_open:
            self._out.write("\n")
            self._text_open = False
        usage = self._usage
        self._out.write(
            f"\ninterrupted in {self._states[-1]}\n"
            f"path: {' -> '.join(self._states)}\n"
            f"tokens: {usage.input_tokens} in + {usage.output_tokens} out = "
            f"{usage.total_tokens} total, and {self._tools} tool call(s), so far\n"
        )
        self._out.flush()

    def _line(self, text: str) -> None:
        if self._text_open:
            self._out.write("\n")
            self._text_open = False
        self._out.write(text + "\n")
        self._out.flush()

    def show(self, event: AgentEvent) -> None:
        """Print what `event` tells, if anything."""
        self._count(event)
        match event:
            case InferenceStream(delta=TextDelta(text=text)):
                if not self._text_open:
                    self._out.write("model: ")
                    self._text_open = self._streamed = True
                # A chunk may end inside an escape sequence: each is made
                # printable alone, so no part of one reaches the terminal.
                self._out.write(printable(text))
                self._out.flush()
            case LoopTransition():
                self._line(f"[{event.source} --{event.trigger}--> {event.dest}]")
            case InferenceCompleted() if event.output.finish_reason == "length":
                self._line("(the output was cut at the token limit)")
            case FunctionCallStarted():
                call = event.call
                self._line(f"  call {_one(call.name)}({_one(call.arguments)})")
            case FunctionCallCompleted():
                status = "error" if event.output.is_error else "->"
                self._line(
                    f"  {_one(event.call.name)} {status} "
                    f"{printable(event.output.output)} ({event.duration * 1000:.0f} ms)"
                )
            case ModelAnswer() if not self._streamed:
                self._line(f"model: {printable(event.message.content)}")
            case LoopFailed():
                self._line(
                    f"failed: {_one(event.error_type)}: {printable(event.message)}"
                )
            case _:
                pass

    def _count(self, event: AgentEvent) -> None:
        if isinstance(event, LoopTransition):
            self._states.append(str(event.dest))
        elif isinstance(event, InferenceCompleted) and event.output.token_usage:
            self._usage = self._usage + event.output.token_usage
        elif isinstance(event, FunctionCallCompleted):
            self._tools += 1


def _one(text: str) -> str:
    """A name or arguments from the model, `printable` on one line."""
    return printable(text, newlines=False)


class _LoadDisplay:
    """Shows a local model loading: a line when it starts (with a running clock
    on a terminal), then the time it took."""

    __slots__ = ("_label", "_out", "_started", "live")

    def __init__(self, out: TextIO, *, live: bool) -> None:
        self._out = out
        self.live = live
        """Whether the line is rewritten in place (a terminal) to show a clock."""
        self._label = ""
        self._started: float | None = None

    def __call__(self, progress: LoadProgress) -> None:
        if progress.phase == "loading":
            self._started = time.monotonic()
            size = progress.size_bytes / 1e6
            name = Path(progress.path).name
            label = f"loading {progress.model} ({name}, {size:.0f} MB)..."
            self._label = printable(label, newlines=False)
            self._out.write(self._label)
        else:
            self._started = None
            again = f"\r{self._label}" if self.live else ""
            self._out.write(f"{again} loaded in {progress.seconds:.1f}s\n")
        self._out.flush()

    async def tick(self) -> None:
        """Update the clock on the loading line until cancelled."""
        while True:
            await anyio.sleep(0.2)
            if self._started is not None:
                elapsed = time.monotonic() - self._started
                self._out.write(f"\r{self._label} {elapsed:.1f}s")
                self._out.flush()
