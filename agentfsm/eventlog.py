"""The event log: every event of every loop, one JSON object per line.

`Runtime(event_log="events.jsonl")` turns it on: the runtime subscribes an
`EventLogWriter` to its bus before the first loop starts and closes it after the
last loop ended, so the file holds every event of every loop, the final
`loop.idle` of loops cancelled at exit included. `read_events` gives the same
pydantic events back:

```python
async with Runtime(providers=providers, event_log="events.jsonl") as runtime:
    runtime.run_loop("agent-1", "hello", inference_input)

for event in read_events("events.jsonl"):
    print(event.seq, event.type)
```

`agentfsm inspect events.jsonl` shows what is in a log (see `agentfsm.timeline`).

How the writer keeps every event:

- Its subscription asks for `backpressure=True`: when its buffer is full, loops
  wait for room instead of the bus dropping events for it.
- Events reach the file in the order the bus delivered them, which keeps each
  loop's order (`seq` 1, 2, 3, ... without holes).
- Writes happen off the event loop: the writer takes every event waiting in its
  buffer as one batch, and a worker thread serializes the batch and appends it
  to the file, unbuffered: straight to the operating system. A slow disk then
  delays only the writer, and loops wait only when the buffer is full; one
  thread hop per batch (rather than per event) keeps the cost low under load.
  Each batch is with the OS once written, so a crash of the process loses
  nothing written; it does not `fsync`.
- A writer killed mid-line (kill -9) leaves a torn last line. The next writer
  ends it before appending, and `read_events` skips it with a warning.
- It is shielded from cancellation and stops only once its subscription is
  closed and drained, so loops cancelled when the runtime exits (or when a
  scope around it is cancelled) can still publish their last events. Once
  the runtime is cancelled, a write that stalls for `STALL_SECONDS` is given
  up on, so a stalled disk cannot hold the exit forever.
- A write that fails (a full disk) never fails or holds a loop: the writer
  goes on taking events without writing them, and the exit says how many
  were written and which were not (`EventLogError`; a warning when a
  cancellation or another error is what leaves the runtime).

Images are kept once, beside the log: a line holds an image by reference
(`"data": null` with its digest, media type and size, as
`context=messages.REFERENCE` dumps it), and its bytes are a file of the
directory `<log>.images/`, named by their digest (`<sha256 hex>.png`),
written (whole, under a temporary name, then renamed) before the first line
that refers to it. An image a loop's message, its context, a tool's output and
the transitions carry is one file, whatever number of events name it, and
the log stays a file of text lines. `read_events` gives the events back with
the bytes, read from that directory: copy it with the log. An image whose
file is missing, or whose bytes are not those of its digest, is an
`EventLogError` naming the line, the digest and the file (the event cannot be
given back without it: an image block holds its bytes).
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from types import TracebackType
from typing import IO, Any, ClassVar, Final, Self

import anyio
from anyio.abc import TaskGroup
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticSerializationError

from ._arguments import ArgumentValueError, check, file_mode_of, private_opener
from ._bus import EventBus, Subscription
from ._logging import get_logger
from ._models import json_of
from ._text import json_text
from .events import AgentEvent, AgentEventAdapter
from .exceptions import EventLogError, LoopStateError
from .messages import REFERENCE, ImageBlock

__all__ = ("EventLogWriter", "images_dir", "read_events")

_BATCH = 1000
"""At most this many events per write (one worker-thread hop)."""

_EXTENSIONS: Final = {
    "image/png": "png",
    "image/jpeg": "jpg",
    "image/gif": "gif",
    "image/webp": "webp",
}
"""An image file's name ends with its type's extension (`IMAGE_MEDIA_TYPES`)."""

_IMAGE_MARK: Final = b',"data":null,"media_type":"image/'
"""What a line that holds an image by reference holds (a quick test)."""

_IMAGE_REFERENCE: Final = re.compile(
    rb'"type":"image","data":null,"media_type":"(image/[a-z]+)","url":null,'
    rb'"digest":"sha256:([0-9a-f]{64})"'
)
"""An image block by reference, as the writer dumps it (its fields in their
order, compact). Inside a JSON string a quote is escaped, so these bytes are
an image block of the event and never text a user wrote."""


def images_dir(path: str | os.PathLike[str]) -> str:
    """The directory that keeps the images of the event log `path`:
    `<path>.images`."""
    return os.fspath(path) + ".images"


def _image_file(directory: str, media_type: str, digest_hex: str) -> str:
    return os.path.join(directory, f"{digest_hex}.{_EXTENSIONS[media_type]}")


class EventLogWriter:
    """Appends every event a bus publishes to a JSON-lines file.

    `Runtime(event_log=path)` creates and closes one for you. Used directly, it
    must stay open until the loops it should record have ended:

    ```python
    runtime = Runtime(providers=providers)
    async with EventLogWriter(runtime.bus, "events.jsonl"), runtime:
        ...
    ```

    When writing fails (a full disk: `OSError` ENOSPC), the loops go on: the
    writer logs an `event_log_failed` warning naming the file and the error,
    keeps taking events without writing them (so loops never wait for it),
    and counts them. Closing it then logs `event_log_incomplete`, saying how
    many events were written and which were not, and raises `EventLogError`
    saying the same (unless the caller is being cancelled: cancellation goes
    on, and the warning is the report).

    A disk that stalls (a write that never returns) delays closing as long as
    it stalls; once the caller is cancelled, the writer waits at most
    `STALL_SECONDS` for the next batch to be written, then gives up on the
    write in its thread and reports the events not written.

    Args:
        bus: the bus to record.
        path: the file; it is created if missing and appended to otherwise.
        buffer: how many events may wait for the writer before loops wait.
        file_mode: the permissions of a file it creates (less the umask):
            readable by its owner only by default, since events hold prompts
            and tool outputs. An existing file keeps its own.

    Raises:
        EventLogError: on exit, when writing failed (the error says how many
            events were written and which were not).
    """

    STALL_SECONDS: ClassVar[float] = 5.0
    """Once the caller of `aclose` is cancelled, the longest a batch may take to
    be written before the writer gives up on it (a stalled disk must not hold
    a cancelled runtime's exit forever; a slow one still drains)."""

    def __init__(
        self,
        bus: EventBus,
        path: str | os.PathLike[str],
        *,
        buffer: int = 10_000,
        file_mode: int = 0o600,
    ) -> None:
        check("bus", bus, EventBus)
        check("path", path, str | os.PathLike, "a str or a path")
        check("buffer", buffer, int)
        if buffer < 1:
            raise ArgumentValueError(f"buffer must be at least 1, got {buffer}")
        self.bus = bus
        self.path = os.fspath(path)
        self._file_mode = file_mode_of(file_mode)
        self.written = 0
        """Events written so far."""
        self.lost = 0
        """Events not written, because writing failed or stalled."""
        self._first_lost: dict[str, int] = {}
        """For each loop with events not written, the `seq` of the first one."""
        self._buffer = buffer
        self._file: IO[bytes] | None = None
        self._subscription: Subscription | None = None
        self._tg: TaskGroup | None = None
        self._scope: anyio.CancelScope | None = None
        self._done: anyio.Event | None = None
        self._batch: Sequence[AgentEvent] = ()
        """The batch being written (what is lost if its write is given up)."""
        self._error: BaseException | None = None
        self._closed = False
        # The worker thread and aclose() agree under this lock on who closes the
        # file: aclose(), unless it gave up on a write still running in the thread.
        self._lock = threading.Lock()
        self._writing = False
        self._abandoned = threading.Event()
        self._images_dir = images_dir(self.path)
        self._kept: set[str] = set()
        """The digests of the images whose files are in `_images_dir` (written
        by this writer, or found there). Used in the worker thread only."""

    async def __aenter__(self) -> Self:
        if self._subscription is not None:
            raise LoopStateError("an EventLogWriter can be entered only once")
        self._subscription = self.bus.subscribe(
            "*", buffer=self._buffer, backpressure=True
        )
        try:
            self._file = await anyio.to_thread.run_sync(
                _open_for_append, self.path, self._file_mode
            )
        except BaseException:
            self._subscription.close()
            raise
        # The writer has a task group of its own: a runtime enters it before the
        # loops' task group and leaves it after, so that the writer outlives every
        # loop. In the loops' group it would be cancelled with them when an error
        # leaves the runtime, while their cleanup still publishes.
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        # Shielded: the writer stops when its subscription is closed and drained,
        # never in the middle, so no event a loop published is lost; only
        # aclose() cancels it, on a write that stalled.
        self._scope = anyio.CancelScope(shield=True)
        self._done = anyio.Event()
        tg.start_soon(self._run, name=f"agentfsm event log {self.path}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop recording, write what is still buffered, close the file.

        Raises:
            EventLogError: writing failed or stalled: some events were not written.
        """
        if self._closed or self._tg is None:
            return
        self._closed = True
        assert self._subscription is not None
        assert self._done is not None
        self._subscription.close()  # ends the writer once it has drained the buffer
        try:
            await self._done.wait()
        except anyio.get_cancelled_exc_class():
            # Cancelled: the loops' last events are still worth writing, unless
            # the disk stalled. What was not written is reported as a warning
            # only: an error raised here would replace the cancellation.
            with anyio.CancelScope(shield=True):
                await self._drain_unless_stalled()
            raise
        finally:
            # The writer has finished: close and report before collecting its
            # task, which re-raises a cancellation (on asyncio).
            try:
                self._close_file()
                self._report()
            finally:
                await self._tg.__aexit__(None, None, None)
        if self.lost or self._error is not None:
            raise EventLogError(self._incomplete()) from self._error

    async def _drain_unless_stalled(self) -> None:
        assert self._done is not None
        assert self._scope is not None
        while not self._done.is_set():
            progress = self.written + self.lost
            with anyio.move_on_after(self.STALL_SECONDS):
                await self._done.wait()
            if not self._done.is_set() and self.written + self.lost == progress:
                self._error = self._error or TimeoutError(
                    f"a write took more than {self.STALL_SECONDS:g}s after the "
                    "runtime was cancelled (a stalled disk?)"
                )
                self._scope.cancel()  # gives up on the write in its thread
                await self._done.wait()

    async def _run(self) -> None:
        assert self._subscription is not None
        assert self._scope is not None
        assert self._done is not None
        subscription = self._subscription
        try:
            with self._scope:
                while True:
                    try:
                        batch = await subscription.receive_batch(_BATCH)
                    except anyio.EndOfStream:
                        return
                    if self._error is not None:
                        self._lose(batch)  # taken, so that loops never wait
                        continue
                    self._batch = batch
                    before = self.written
                    try:
                        await anyio.to_thread.run_sync(
                            self._write, batch, abandon_on_cancel=True
                        )
                    except Exception as exc:  # noqa: BLE001 - reported by aclose(), never into the group
                        self._error = exc
                        self._lose(batch[self.written - before :])
                        get_logger().warning(
                            "event_log_failed",
                            path=self.path,
                            error=f"{type(exc).__name__}: {exc}",
                            written=self.written,
                            detail="later events are counted, not written",
                        )
                    self._batch = ()
        finally:
            if self._scope.cancelled_caught:  # gave up on a stalled write
                self._lose(self._batch)
                while True:
                    try:
                        self._lose([subscription.receive_nowait()])
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
            self._done.set()

    def _lose(self, events: Sequence[AgentEvent]) -> None:
        self.lost += len(events)
        for event in events:
            self._first_lost.setdefault(event.loop_id, event.seq)

    def _write(self, batch: Sequence[AgentEvent]) -> None:
        """Serialize and append one batch (runs in a worker thread).

        The file is unbuffered: each write goes to the operating system, and a
        failed write leaves nothing behind for `close()` to fail on again.
        `written` counts each event once its whole line is written.
        """
        with self._lock:
            if self._abandoned.is_set():
                return
            self._writing = True
        try:
            assert self._file is not None
            # An event's images are written (each once) as its line is made:
            # before any line of the batch.
            lines = [self._line(event) for event in batch]
            data = memoryview(b"".join(lines))
            done = 0
            ends = itertools.accumulate(len(line) for line in lines)
            end = next(ends)
            while done < len(data):
                done += self._file.write(data[done:]) or 0
                while end <= done:
                    self.written += 1
                    end = next(ends, len(data) + 1)
        finally:
            with self._lock:
                self._writing = False
                if self._abandoned.is_set() and self._file is not None:
                    self._file.close()

    def _line(self, event: AgentEvent) -> bytes:
        """The event's line, its images by reference (their files written)."""
        try:
            text = json_of(event, context=REFERENCE)
        except PydanticSerializationError:
            # Text that did not enter through a loop: its lone surrogates escaped.
            text = json_text(event.model_dump(mode="json", context=REFERENCE))
        line = text.encode()
        if _IMAGE_MARK in line:
            for image in _images_of(event):
                self._keep(image)
        return line + b"\n"

    def _keep(self, image: ImageBlock) -> None:
        """Write the image's file, unless it is there: whole, under a temporary
        name renamed into place, so that a file of its name is never torn."""
        digest = image.digest
        data = image.data
        if digest is None or data is None or digest in self._kept:
            return
        media_type = image.media_type
        if media_type not in _EXTENSIONS:
            return  # not a valid block (built without validation): no file
        directory = self._images_dir
        final = _image_file(directory, media_type, digest.removeprefix("sha256:"))
        try:
            there = os.path.getsize(final) == len(data)
        except FileNotFoundError:
            there = False
        if not there:  # (a file of another size is not the image: replaced)
            # Searchable as the file's is readable: 0o600 gives 0o700.
            os.makedirs(
                directory,
                mode=self._file_mode | (self._file_mode & 0o444) >> 2,
                exist_ok=True,
            )
            temporary = f"{final}.{os.getpid()}.{threading.get_ident()}.tmp"
            fd = os.open(
                temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, self._file_mode
            )
            with open(fd, "wb") as file:
                file.write(data)
            os.replace(temporary, final)
        self._kept.add(digest)

    def _close_file(self) -> None:
        assert self._file is not None
        with self._lock:
            self._abandoned.set()
            if self._writing:
                return  # the thread closes the file when its write returns
        try:
            self._file.close()
        except OSError as exc:  # nothing is buffered; reported all the same
            self._error = self._error or exc

    def _report(self) -> None:
        if self.lost or self._error is not None:
            get_logger().warning(
                "event_log_incomplete",
                path=self.path,
                written=self.written,
                not_written=self.lost,
                error=self._incomplete(),
            )

    def _incomplete(self) -> str:
        """What was not written, and why."""
        error = self._error
        why = "" if error is None else f": {type(error).__name__}: {error}"
        text = f"writing the event log {self.path} failed{why}; "
        text += f"{self.written} events were written, {self.lost} were not"
        loops = sorted(self._first_lost.items())
        if loops:
            named = ", ".join(f"{loop} from seq {seq}" for loop, seq in loops[:3])
            more = f" and {len(loops) - 3} more" if len(loops) > 3 else ""
            text += f" (of loop{'s' if len(loops) > 1 else ''} {named}{more})"
        return text


def _open_for_append(path: str, mode: int) -> IO[bytes]:
    # "a+": every write appends, and the last byte can be read. Unbuffered (see
    # `EventLogWriter._write`). The writer closes the file in aclose(); here only
    # when ending a torn line fails.
    file = open(path, "a+b", buffering=0, opener=private_opener(mode))  # noqa: SIM115 - returned open, see above
    try:
        end = file.seek(0, os.SEEK_END) if file.seekable() else 0
        if end:
            file.seek(end - 1)
            if file.read(1) != b"\n":
                # A writer was killed mid-line: end its torn line, so that this
                # run's first event starts a line of its own and reads back.
                file.write(b"\n")
    except BaseException:
        file.close()
        raise
    return file


def read_events(
    path: str | os.PathLike[str], *, on_skip: Callable[[int], None] | None = None
) -> Iterator[AgentEvent]:
    """The events of an event log, in file order (each loop's in `seq` order).

    Blank lines are skipped, and so are torn lines: lines that are not valid
    JSON, because a writer was killed in the middle of writing them. One is
    the last line of a log whose run was killed, or, once the next run appended
    to the log, a line anywhere in it; an event the next run wrote on the same
    line (writers before this one did not start a new line) is still read.
    Each line skipped is reported: to `on_skip(line_number)` when given, else
    as an `event_log_line_skipped` warning of the agentfsm logger, naming the
    file and the line.

    An image a line holds by reference is given back with its bytes, from its
    file in `<path>.images/` (see the module).

    Args:
        path: the event log.
        on_skip: called with the number (from 1) of each torn line skipped,
            instead of the warning.

    Raises:
        EventLogError: a line is JSON but not an agentfsm event, or refers to
            an image whose file is missing or damaged (the error names the
            line, and the image's digest and file).
        OSError: the file cannot be read.
    """
    name = os.fspath(path)
    images = _ImageFiles(name)
    with open(name, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if _IMAGE_MARK in line:
                line = images.inlined(line, number)
            try:
                yield AgentEventAdapter.validate_json(line)
            except ValidationError as exc:
                if not _is_torn(exc):
                    raise EventLogError(
                        f"{name}, line {number}: not an agentfsm event: "
                        f"{_first_error(exc)}"
                    ) from exc
                if on_skip is not None:
                    on_skip(number)
                else:
                    get_logger().warning(
                        "event_log_line_skipped",
                        path=name,
                        line=number,
                        reason="torn: not valid JSON (a writer killed mid-line)",
                    )
                glued = _glued_event(line)
                if glued is not None:
                    yield glued


class _ImageFiles:
    """The images of an event log, read from their files as its lines name
    them (the last few read kept: an image is named by several events)."""

    def __init__(self, log: str) -> None:
        self.log = log
        self.directory = images_dir(log)
        self._base64 = lru_cache(maxsize=16)(self._read)

    def inlined(self, line: bytes, number: int) -> bytes:
        """`line` with each image it holds by reference given its bytes.

        Raises:
            EventLogError: an image's file is missing or damaged.
        """

        def bytes_of(found: re.Match[bytes]) -> bytes:
            media_type, digest_hex = found[1].decode(), found[2].decode()
            try:
                data = self._base64(media_type, digest_hex)
            except _ImageFileError as exc:
                raise EventLogError(
                    f"{self.log}, line {number}: the image sha256:{digest_hex} {exc}"
                ) from None
            return found[0].replace(b'"data":null', b'"data":"' + data + b'"', 1)

        return _IMAGE_REFERENCE.sub(bytes_of, line)

    def _read(self, media_type: str, digest_hex: str) -> bytes:
        """The image's bytes, as base64, checked against its digest."""
        if media_type not in _EXTENSIONS:
            raise _ImageFileError(f"has the unknown media type {media_type!r}")
        file = _image_file(self.directory, media_type, digest_hex)
        try:
            with open(file, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise _ImageFileError(
                f"is missing: no file {file} (an event log keeps its images "
                f"beside it, in {self.directory}: copy it with the log)"
            ) from None
        if hashlib.sha256(data).hexdigest() != digest_hex:
            raise _ImageFileError(
                f"is damaged: the {len(data):,} bytes of {file} are not those "
                "of its digest"
            )
        return base64.b64encode(data)


class _ImageFileError(Exception):
    """An image's file cannot give its bytes (`_ImageFiles` names the line)."""


def _images_of(value: Any) -> Iterator[ImageBlock]:
    """The image blocks of bytes in `value` (an event: models, sequences,
    mappings of them)."""
    if type(value) is ImageBlock:
        if value.data is not None:
            yield value
    elif isinstance(value, BaseModel):
        for item in value.__dict__.values():
            yield from _images_of(item)
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _images_of(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _images_of(item)


_EVENT_START = b'{"event_id":"'
"""How every line the writer writes starts. Inside a JSON string a quote is
escaped, so in a line these bytes mark the start of an event and nothing else."""


def _is_torn(exc: ValidationError) -> bool:
    """Whether validating a line failed because it is not JSON at all."""
    errors = exc.errors(include_url=False)
    return len(errors) == 1 and errors[0]["type"] == "json_invalid"


def _glued_event(line: bytes) -> AgentEvent | None:
    """The whole event after a torn start on one line, if there is one (the
    next run's first event, appended by a writer that did not start a new line)."""
    start = line.rfind(_EVENT_START)
    if start <= 0:
        return None
    try:
        return AgentEventAdapter.validate_json(line[start:])
    except ValidationError:
        return None


def _first_error(exc: ValidationError) -> str:
    error = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in error["loc"])
    return f"{where}: {error['msg']}" if where else error["msg"]
