"""`agentfsm run`: run one agent loop on a real model and watch it happen.

```text
agentfsm run "What is 2 + 3?" --tool agentfsm.cli.demo_tools:add --tool-choice add
agentfsm run "What is 2 + 3?" --mcp "python examples/mcp_calc_server.py"
agentfsm run "What is 2 + 3?" --tool agentfsm.cli.demo_tools:add --needs-approval add
agentfsm run "What is 2 + 3?" --tool agentfsm.cli.demo_tools:add --break function_call
agentfsm run "What is in this picture?" --model openai:gpt-4.1 --image cat.png
```

The answer streams to the terminal as it comes; each transition and tool call
is shown as it happens (from the event bus), a running tool with a spinner and
its progress, progress while a local model loads, and at the end the path the
loop took and the tokens it used.

A loop that pauses (a tool call needs approval, or a handler paused it) is
answered at the terminal: approve each call, deny it with a reason, or edit
its arguments; any other pause is resumed or aborted. `--break STATE` pauses
the loop before each transition into STATE (`--step`: before every
transition), and the prompt resumes or aborts it there (see
`agentfsm.breakpoints`). Without a terminal (stdin or stdout not a tty)
nobody can answer: the pause and how to resume a loop are printed, and the
command exits 3.

`--image PATH` (repeatable) sends images with the question: the message is
the question's text, then each image in order (the images alone, when the
question is empty). A file that is not an image the library takes (PNG,
JPEG, GIF or WebP, its bytes saying which, at most 20 MiB) is refused, named,
when the command line is read, before anything starts; a model that takes
no image refuses the message before the loop starts (exit 2). A tool's
images are shown by their reference (`[image: image/png, 4,035 bytes,
sha256:...]`).

Ctrl-C says at once that the loop is stopping, stops it and tells how far it
got. A tool still running in a thread (interrupted, or past its timeout) is
left to finish on its own, and the process does not wait for it, however the
run ended. A second Ctrl-C ends the process at once.

At the approval prompt, edited arguments are checked as the loop will parse
them; a terminal passes at most 4095 bytes a line, so longer arguments are
read from a file: `@args.json`.

Exit codes: 0 the loop answered; 1 it ended any other way (the outcome and
the error are printed); 2 a bad command line (an empty question, an unknown
model or tool, an image refused, a missing extra, an MCP server that cannot
be reached); 3 the
loop paused with no terminal to ask; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import anyio
import structlog
from pydantic import ValidationError

from agentfsm import (
    AgentFSMError,
    Break,
    InferenceInput,
    LoopResult,
    ModelContext,
    Runtime,
    Tool,
)
from agentfsm._text import printable, printable_log
from agentfsm.events import LoopDetached, LoopIdle, LoopPaused
from agentfsm.exceptions import ConfigurationError, ProviderError
from agentfsm.inference import TOOL_CHOICE_MODES
from agentfsm.messages import ImageBlock, TokenUsage, UserMessage
from agentfsm.providers import Provider, split_model
from agentfsm.providers.local import DEFAULT_MODEL, LocalProvider
from agentfsm.results import LoopStatus, LoopView
from agentfsm.states import LoopState, Outcome
from agentfsm.tools import format_validation_error

from ._interrupt import INTERRUPTED_EXIT, Interrupts, leave_threads
from ._pause import PAUSED_EXIT, PauseDecider, ask_terminal, unattended
from ._text import one_line
from ._view import LoadDisplay, RunView

__all__ = (
    "PAUSED_EXIT",
    "add_parser",
    "breakpoints_of",
    "image_file",
    "load_tool",
    "message_of",
    "run",
    "with_mcp_tools",
)

DEFAULT_INSTRUCTIONS = (
    "You are a helpful assistant. Answer with the results of the tools you call."
)


def add_parser(commands: Any) -> None:
    """Register `run` and its arguments."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "run",
        help="run one agent loop on a model and stream its answer",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("question", help="the user message the loop starts with")
    parser.add_argument(
        "--image",
        action="append",
        default=[],
        type=image_file,
        metavar="PATH",
        help="send an image file (PNG, JPEG, GIF or WebP) after the question's "
        "text; repeatable, in order",
    )
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
    parser.add_argument(
        "--needs-approval",
        action="append",
        default=[],
        metavar="TOOL",
        help="ask before each call of TOOL (offered by --tool or --mcp): "
        "approve, deny or edit it at the terminal; repeatable",
    )
    parser.add_argument(
        "--approve-all",
        action="store_true",
        help="approve every call that needs approval, without asking",
    )
    parser.add_argument(
        "--break",
        dest="breaks",
        action="append",
        default=[],
        choices=[s.value for s in LoopState],
        metavar="STATE",
        help="pause before each transition into STATE (inference covers "
        "streaming requests too), to resume or abort at the prompt; repeatable",
    )
    parser.add_argument(
        "--step",
        action="store_true",
        help="pause before every transition of the loop (step mode)",
    )
    parser.set_defaults(handler=run)


_EPILOG = f"""\
a pause (a tool call that needs approval, a --break or --step stop) is
answered at the terminal; with no terminal to ask, the command prints the
pause and exits {PAUSED_EXIT}.
Ctrl-C stops the loop (a second one ends the process at once).

exit codes: 0 answered, 1 the loop ended otherwise, 2 a bad command line
or an MCP server that cannot be reached, {PAUSED_EXIT} paused with no terminal to
ask, {INTERRUPTED_EXIT} interrupted"""


def run(args: argparse.Namespace) -> int:
    """Run the loop; returns the exit code."""
    if not args.question.strip() and not args.image:
        return _error(
            "error: the question is empty: give the message the loop starts "
            "with, e.g. agentfsm run 'What is 2 + 3?'",
            2,
        )
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
    view = RunView(sys.stdout, live=sys.stdout.isatty())
    interrupts = Interrupts()
    before = set(threading.enumerate())
    try:
        with interrupts.installed():
            code = anyio.run(_run, args, request, view, interrupts)
    except KeyboardInterrupt:  # outside the main thread, where no handler is ours
        view.end_line()
        code = INTERRUPTED_EXIT
    finally:
        structlog.configure(**saved)
    if code == INTERRUPTED_EXIT:
        _error("interrupted", code)
    # Whatever the outcome: a sync tool still running past its timeout would
    # otherwise hold the process at exit (`threading._shutdown`).
    leave_threads(code, before)
    return code


def image_file(path: str) -> ImageBlock:
    """`--image PATH`: the file as an image block, read and checked now.

    Raises:
        argparse.ArgumentTypeError: it cannot be read, or is not an image the
            library takes (its type, its size); the message names it.
    """
    shown = one_line(path)
    try:
        return ImageBlock.from_path(path)
    except OSError as exc:
        raise argparse.ArgumentTypeError(
            f"{shown}: cannot be read: {exc.strerror or exc}"
        ) from None
    except ValidationError as exc:
        why = "; ".join(
            str(e["msg"]).removeprefix("Value error, ")
            for e in exc.errors(include_url=False)
        )
        raise argparse.ArgumentTypeError(f"{shown}: not an image: {why}") from None
    except ValueError as exc:  # over MAX_IMAGE_BYTES (it names the file)
        raise argparse.ArgumentTypeError(one_line(str(exc))) from None


def message_of(args: argparse.Namespace) -> str | UserMessage:
    """The message the loop starts with: the question, then its `--image`s."""
    if not args.image:
        return str(args.question)
    text = [args.question] if args.question.strip() else []
    return UserMessage(content=[*text, *args.image])


def breakpoints_of(args: argparse.Namespace) -> list[Break]:
    """The breakpoints `--break` and `--step` ask for (a step stops before
    every transition: it covers any `--break`)."""
    if args.step:
        return [Break.every()]
    return [Break(state) for state in dict.fromkeys(args.breaks)]


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
    tools = _with_approval(tools, args.needs_approval, check=check_choice)
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


def _with_approval(
    tools: Sequence[Tool], names: Sequence[str], *, check: bool
) -> list[Tool]:
    """`tools`, with those `--needs-approval` names made to ask first (copies:
    a module's tool is shared with whoever imports it)."""
    wanted = set(names)
    if check and (unknown := sorted(wanted - {t.name for t in tools})):
        offered = ", ".join(t.name for t in tools) or "none (use --tool or --mcp)"
        raise ConfigurationError(
            f"--needs-approval {unknown[0]!r} names no tool offered (offered: {offered})"
        )
    marked = []
    for tool in tools:
        if tool.name in wanted and tool.needs_approval is not True:
            tool = copy.copy(tool)
            tool.needs_approval = True
        marked.append(tool)
    return marked


def _error(message: str, code: int) -> int:
    # Errors quote what a model, a tool or a server said.
    print(printable(message), file=sys.stderr)
    return code


async def _run(
    args: argparse.Namespace,
    request: InferenceInput,
    view: RunView,
    interrupts: Interrupts,
) -> int:
    run = _Run(view)
    code = INTERRUPTED_EXIT
    async with anyio.create_task_group() as tg:

        async def stop_at_interrupt() -> None:
            await interrupts.wait()
            if interrupts.told and _one_terminal(sys.stdout, sys.stderr):
                run.view.line_ended()  # by the handler's line, on stderr
            # Told at once, from the loop as it is now: what stopping it takes
            # (a tool's cleanup, an MCP server's exit) may take a while.
            run.interrupted()
            tg.cancel_scope.cancel()

        tg.start_soon(stop_at_interrupt)
        if view.live:
            tg.start_soon(view.spin)
        code = await _session(args, request, run)
        tg.cancel_scope.cancel()
    return INTERRUPTED_EXIT if interrupts.interrupted else code


async def _session(args: argparse.Namespace, request: InferenceInput, run: _Run) -> int:
    providers: dict[str, Provider] = {}
    try:
        prefix = split_model(request.model)[0]
        if prefix != "local" and (
            args.base_url is not None or args.api_key is not None
        ):
            providers[prefix] = _remote(prefix, args.base_url, args.api_key)
        async with Runtime(
            providers=providers,
            event_log=args.events,
            breakpoints=breakpoints_of(args),
        ) as runtime:
            # The servers first: one that cannot be reached fails the command
            # before a local model takes its seconds to load.
            request = await with_mcp_tools(runtime, args, request)
            if prefix == "local":
                runtime.providers.register("local", await _load_local(request.model))
            interactive = sys.stdin.isatty() and sys.stdout.isatty()
            decider = PauseDecider(
                {tool.name: tool for tool in request.tools},
                ask=ask_terminal if interactive else None,
                approve_all=args.approve_all,
                out=sys.stdout,
            )
            result = await _watch(
                runtime,
                args,
                request,
                sys.stdout,
                run.view,
                pauses=decider,
                started=run.started,
            )
    except _Unanswered as exc:
        return _error(unattended(exc.paused), PAUSED_EXIT)
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
    loading = LoadDisplay(sys.stderr, live=sys.stderr.isatty())
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


class _Unanswered(Exception):
    """The loop paused and nobody could answer (no terminal)."""

    def __init__(self, paused: LoopView) -> None:
        super().__init__(paused.loop_id)
        self.paused = paused


async def _watch(
    runtime: Runtime,
    args: argparse.Namespace,
    request: InferenceInput,
    out: TextIO,
    view: RunView | None = None,
    *,
    pauses: PauseDecider | None = None,
    started: Callable[[Runtime, str], None] | None = None,
) -> LoopResult:
    """Run the loop, show its events and answer its pauses; its result.

    Raises:
        _Unanswered: it paused and `pauses` had nobody to ask (the loop is
            cancelled).
    """
    view = RunView(out) if view is None else view
    if pauses is None:
        pauses = PauseDecider({}, ask=None, approve_all=args.approve_all, out=out)
    # Subscribe before the loop starts so no event is missed; backpressure, so
    # every chunk is shown however fast the model streams.
    with runtime.bus.subscribe("*", backpressure=True) as events:
        loop_id = runtime.run_loop(
            "cli",
            message_of(args),
            request,
            max_turns=args.max_turns,
        )
        if started is not None:
            started(runtime, loop_id)
        async for event in events:
            view.show(event)
            if isinstance(event, LoopPaused):
                await _answer(runtime, loop_id, pauses, view)
            elif isinstance(event, LoopIdle | LoopDetached):
                break  # no event of the loop follows either
    return await runtime.wait(loop_id)


async def _answer(
    runtime: Runtime, loop_id: str, pauses: PauseDecider, view: RunView
) -> None:
    """Resume the paused loop as `pauses` decides."""
    paused = runtime.get(loop_id)
    if paused.status is not LoopStatus.paused:
        return  # it was cancelled meanwhile; its end follows
    view.end_line()
    decision = await pauses.decide(paused)
    if decision is None:
        runtime.cancel(loop_id, "paused, with no terminal to ask")
        raise _Unanswered(paused)
    runtime.resume(loop_id, decision)


def _summary(result: LoopResult) -> int:
    print(f"\npath: {' -> '.join(result.states)}")
    # `str(usage)` says "unknown" when the server reported none, never 0.
    print(
        f"tokens: {result.usage}, over {result.model_requests} model request(s) "
        f"and {result.tool_calls} tool call(s)"
    )
    print(f"outcome: {result.outcome}")
    if result.outcome is Outcome.answered:
        return 0
    detail = f"{result.error.type}: {result.error.message}" if result.error else None
    return _error(f"loop {result.outcome}: {detail or result.reason or 'no answer'}", 1)


class _Run:
    """The loop a run started, for what Ctrl-C tells of it."""

    __slots__ = ("loop_id", "runtime", "view")

    def __init__(self, view: RunView) -> None:
        self.view = view
        self.runtime: Runtime | None = None
        self.loop_id: str | None = None

    def started(self, runtime: Runtime, loop_id: str) -> None:
        self.runtime = runtime
        self.loop_id = loop_id

    def interrupted(self) -> None:
        """End the line being written and tell how far the loop got."""
        self.view.end_line()
        loop = None
        if self.runtime is not None and self.loop_id is not None:
            loop = self.runtime.get(self.loop_id)
        _interrupted(loop, sys.stdout)


def _one_terminal(out: TextIO, err: TextIO) -> bool:
    """Whether `out` and `err` write to one terminal (what one ends, the
    other sees ended)."""
    try:
        same = os.path.samestat(os.fstat(out.fileno()), os.fstat(err.fileno()))
        return same and out.isatty()
    except (OSError, ValueError):  # no file descriptor (captured, closed)
        return False


def _interrupted(loop: LoopView | None, out: TextIO) -> None:
    """Tell where the interrupted loop was: its state (and its pause), path and totals."""
    if loop is None:
        out.write("\ninterrupted before the loop started\n")
        out.flush()
        return
    where = str(loop.state)
    if loop.status is LoopStatus.paused and loop.pending is not None:
        reason = one_line(loop.pause_reason or "")
        where += f", paused before {loop.pending.trigger} ({reason})"
    path = " -> ".join(["idle", *(str(step.dest) for step in loop.path)])
    usage = loop.usage
    in_flight = loop.state in (LoopState.inference, LoopState.inference_streaming)
    if in_flight and loop.status is LoopStatus.running:
        # The request in flight reported nothing yet: counted as one that
        # reported none, as the summary of a loop it ended would count it.
        usage = usage + TokenUsage(unreported_requests=1)
    out.write(
        f"\ninterrupted in {where}\n"
        f"path: {path}\n"
        f"tokens: {usage}, and {loop.tool_calls} tool call(s), so far\n"
    )
    out.flush()
