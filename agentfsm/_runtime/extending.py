"""The runtime's side of the extension seam (`agentfsm.extensions`): each
extension asked once per loop for its part, the parts composed into the loop
(`Loop.extend_with`), and their lifecycle hooks called, guarded.

A hook that raises is logged and passed over: an extension's bookkeeping
never decides whether a loop runs or how the runtime keeps it. Its layers
(provider, tool) are in the loop's path, and fail what they wrap, as a
wrapper would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from agentfsm._arguments import ArgumentTypeError, given
from agentfsm._loop.wrappers import hook_failed
from agentfsm.exceptions import ConfigurationError
from agentfsm.extensions import Extension, LoopExtension, LoopInfo, overrides
from agentfsm.results import LoopStatus

if TYPE_CHECKING:
    from agentfsm._loop import Loop

__all__ = (
    "extend",
    "extensions_checked",
    "loop_ended",
    "run_ended",
    "start_with_extensions",
)


def extensions_checked(extensions: object, name: str = "extensions") -> None:
    """Refuse `Runtime(extensions=)` that is not a sequence of `Extension`s,
    naming the first that is not one."""
    if isinstance(extensions, str | bytes) or not isinstance(extensions, Sequence):
        raise ArgumentTypeError(
            "extensions must be a list of agentfsm.extensions.Extension, "
            f"e.g. [OpenTelemetry()], got {given(extensions)}"
        )
    for index, extension in enumerate(extensions):
        if not isinstance(extension, Extension):
            where = f"extensions[{index}]" if name == "extensions" else name
            raise ArgumentTypeError(
                f"{where} must be an agentfsm.extensions.Extension "
                f"(such as agentfsm.otel.OpenTelemetry()), got {given(extension)}"
            )


def extend(loop: Loop, extensions: Sequence[Extension], *, strict: bool) -> None:
    """Ask each extension for its part in `loop` (just built, or taken up
    from a store) and compose the parts into it.

    An extension whose `open` raises or returns something else than a
    `LoopExtension` or None takes no part: for a loop `run_loop` is starting
    (`strict`) that is the caller's error, raised before anything is stored
    or published; for a loop taken up from a store it is logged, and the
    loop goes on without it.

    Raises:
        ConfigurationError: `strict`, and an extension's `open` failed.
    """
    info = LoopInfo(loop)
    parts: list[LoopExtension] = []
    for extension in extensions:
        name = type(extension).__qualname__
        try:
            part = extension.open(info)
            if part is not None and not isinstance(part, LoopExtension):
                raise ArgumentTypeError(
                    f"{name}.open must return a LoopExtension or None, "
                    f"got {given(part)}"
                )
        except Exception as exc:
            if strict:
                if isinstance(exc, ConfigurationError):
                    raise
                raise ConfigurationError(
                    f"extension {name} could not open loop {loop.loop_id}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            loop.log.error(
                "extension_open_failed",
                extension=name,
                error=f"{type(exc).__name__}: {exc}",
            )
            continue
        if part is not None:
            parts.append(part)
    if parts:
        loop.extend_with(parts)


def start_with_extensions(loop: Loop, start: Callable[[Loop], None]) -> None:
    """Hand `loop` to a worker through its extensions' `start_run` hooks, the
    first outermost. The loop starts exactly once, whatever a hook does: the
    rest of the chain goes on after one that raised or returned without
    calling it (logged), and a second call does nothing. What `start` itself
    raises is the runtime's, and goes to the caller."""
    started = False

    def once() -> None:
        nonlocal started
        if not started:
            started = True
            start(loop)

    call = once
    for part in reversed(loop.extensions):
        if overrides(part, "start_run"):
            call = _guarded_start(loop, part, call)
    call()


def _guarded_start(
    loop: Loop, part: LoopExtension, inner: Callable[[], None]
) -> Callable[[], None]:
    def start_run() -> None:
        called = False
        failed: list[BaseException] = []

        def go_on() -> None:
            nonlocal called
            called = True
            try:
                inner()
            except BaseException as exc:
                failed.append(exc)  # not the hook's: the caller's to see
                raise

        try:
            part.start_run(go_on)
        except Exception as exc:  # noqa: BLE001 - an extension never stops a loop
            if failed:
                raise failed[0]  # noqa: B904 - the runtime's own error, as it was
            hook_failed(loop, part, "start_run", exc)
        else:
            if failed:
                raise failed[0]  # the hook swallowed it
            if not called:
                loop.log.error(
                    "extension_skipped_start", extension=type(part).__qualname__
                )
        if not called:
            inner()

    return start_run


def run_ended(loop: Loop) -> None:
    """A run of `loop` returned: tell its extensions (for the last time, if
    the loop ended or left this runtime)."""
    _notify(loop, "run_ended")
    if loop.status is LoopStatus.done or loop.detached:
        loop.release_extensions()


def loop_ended(loop: Loop) -> None:
    """`loop` ended: tell its extensions (for the last time, if it ended
    without a run: else `run_ended` follows)."""
    _notify(loop, "loop_ended")
    if loop.worker is None:
        loop.release_extensions()


def _notify(loop: Loop, hook: str) -> None:
    for part in loop.extensions:
        if not overrides(part, hook):
            continue
        try:
            getattr(part, hook)()
        except Exception as exc:  # noqa: BLE001 - see the module
            hook_failed(loop, part, hook, exc)
