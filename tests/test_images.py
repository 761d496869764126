"""Images in user messages and tool results: what a block must be, and a loop
refusing an image its model cannot take before the history changes."""

from __future__ import annotations

import base64
import zlib
from pathlib import Path

import pytest
from pydantic import ValidationError

from agentfsm import (
    ImageBlock,
    ImageNotSupported,
    ImageSupport,
    InferenceInput,
    LoopStatus,
    ModelContext,
    Outcome,
    PendingTransition,
    Rewrite,
    Runtime,
    TextBlock,
    Trigger,
    UserMessage,
    tool,
)
from agentfsm.events import FunctionCallCompleted
from agentfsm.inference import NO_IMAGES, InferenceOutput
from agentfsm.messages import (
    MAX_IMAGE_BYTES,
    REFERENCE,
    FunctionCallOutputItem,
)
from agentfsm.messages import (
    UserMessage as Message,
)
from agentfsm.testing import EventRecorder, ScriptedProvider, call, calls, text
from agentfsm.tools import ToolResult
from tests.helpers import wait_until


def png(width: int = 1, payload: bytes = b"") -> bytes:
    """A real PNG of `width` x 1 grey pixels (`payload` in a tEXt chunk)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        crc = zlib.crc32(body).to_bytes(4, "big")
        return len(data).to_bytes(4, "big") + body + crc

    header = width.to_bytes(4, "big") + (1).to_bytes(4, "big") + b"\x08\x00\x00\x00\x00"
    pixels = zlib.compress(b"\x00" + b"\x80" * width)
    extra = chunk(b"tEXt", b"note\x00" + payload) if payload else b""
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + extra
        + chunk(b"IDAT", pixels)
        + chunk(b"IEND", b"")
    )


JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + b"\x00" * 32
GIF = b"GIF89a\x01\x00\x01\x00" + b"\x00" * 16
WEBP = b"RIFF\x24\x00\x00\x00WEBPVP8 " + b"\x00" * 24


class Vision:
    """A provider answering from a script that says where its model takes images."""

    def __init__(self, support: ImageSupport, *script: InferenceOutput) -> None:
        self.support = support
        self.scripted = ScriptedProvider(script or (text("seen"),))
        self.asked: list[str] = []

    def image_support(self, model: str) -> ImageSupport:
        self.asked.append(model)
        return self.support

    async def complete(self, request: InferenceInput, /) -> InferenceOutput:
        return await self.scripted.complete(request)

    def stream(self, request: InferenceInput, /):  # type: ignore[no-untyped-def]
        return self.scripted.stream(request)


def _inference(*tools: object, model: str = "eyes:m") -> InferenceInput:
    return InferenceInput(model=model, context=ModelContext(), tools=tools)  # type: ignore[arg-type]


class TestImageBlock:
    @pytest.mark.parametrize(
        ("data", "media_type"),
        [
            (png(), "image/png"),
            (JPEG, "image/jpeg"),
            (GIF, "image/gif"),
            (WEBP, "image/webp"),
        ],
    )
    def test_the_bytes_say_their_type_and_the_digest_is_theirs(
        self, data: bytes, media_type: str
    ) -> None:
        block = ImageBlock.from_bytes(data)
        assert (block.media_type, block.size) == (media_type, len(data))
        assert block.digest is not None
        assert block.digest.startswith("sha256:")
        assert block == ImageBlock.from_bytes(data, media_type)
        assert block.digest != ImageBlock.from_bytes(png(2)).digest

    @pytest.mark.parametrize(
        ("given", "says"),
        [
            (
                {"data": b"%PDF-1.7 ..."},
                "no PNG, JPEG, GIF or WebP image (starting 25 50 44 46)",
            ),
            (
                {"data": png(), "media_type": "image/jpeg"},
                "a PNG image, not image/jpeg as claimed",
            ),
            (
                {"data": JPEG, "media_type": "image/tiff"},
                "media type 'image/tiff' is not supported",
            ),
            ({"url": "file:///etc/passwd"}, "URL scheme 'file' is not allowed"),
            ({"url": "ftp://example.com/a.png"}, "URL scheme 'ftp' is not allowed"),
            ({"url": "example.com/a.png"}, "URL scheme '(none)' is not allowed"),
            (
                {"url": "data:image/png;base64,%%%"},
                "the data: URL's base64 is not valid",
            ),
            ({"url": "data:image/png;base64"}, "the data: URL has no ','"),
            (
                {"url": "data:text/plain,hello"},
                "media type 'text/plain' is not supported",
            ),
            ({}, "needs data (bytes) or a url"),
            (
                {"data": png(), "url": "https://example.com/a.png"},
                "data or a url, not both",
            ),
            ({"data": png(), "digest": "sha256:00"}, "do not match the digest"),
            ({"data": b""}, "the data is no bytes at all"),
        ],
    )
    def test_bad_blocks_are_refused_saying_why(
        self, given: dict[str, object], says: str
    ) -> None:
        with pytest.raises(ValidationError, match="ImageBlock") as raised:
            ImageBlock(**given)  # type: ignore[arg-type]
        assert says in str(raised.value)

    def test_a_bad_block_in_a_message_names_its_place(self) -> None:
        with pytest.raises(ValidationError) as raised:
            UserMessage.model_validate(
                {
                    "content": [
                        "look",
                        {
                            "type": "image",
                            "data": base64.b64encode(JPEG).decode(),
                            "media_type": "image/png",
                        },
                    ]
                }
            )
        error = raised.value.errors()[0]
        assert error["loc"] == ("content", "blocks", 1, "image")
        assert "a JPEG image, not image/png as claimed" in error["msg"]

    def test_over_the_size_limit(self, tmp_path: Path) -> None:
        big = b"\x89PNG\r\n\x1a\n" + bytes(MAX_IMAGE_BYTES)
        with pytest.raises(
            ValidationError, match=f"more than MAX_IMAGE_BYTES={MAX_IMAGE_BYTES:,}"
        ):
            ImageBlock.from_bytes(big)
        path = tmp_path / "big.png"
        path.write_bytes(big)
        with pytest.raises(ValueError, match=r"big\.png.* more than MAX_IMAGE_BYTES"):
            ImageBlock.from_path(path)

    def test_a_data_url_becomes_bytes_and_a_web_url_stays(self, tmp_path: Path) -> None:
        data = png(3)
        from_url = ImageBlock.from_url(
            "data:image/png;base64," + base64.b64encode(data).decode()
        )
        assert from_url.url is None
        assert from_url.data == data
        assert from_url == ImageBlock.from_bytes(data)
        web = ImageBlock.from_url("https://example.com/cat.png")
        assert (web.url, web.data, web.digest, web.size) == (
            "https://example.com/cat.png",
            None,
            None,
            None,
        )
        (tmp_path / "cat.png").write_bytes(data)
        assert ImageBlock.from_path(tmp_path / "cat.png") == from_url

    def test_json_holds_the_bytes_and_reference_dumps_do_not(self) -> None:
        data = png(payload=b"x" * 500)
        message = UserMessage(content=["what is it?", ImageBlock.from_bytes(data)])
        assert Message.model_validate_json(message.model_dump_json()) == message
        assert Message.model_validate(message.model_dump(mode="json")) == message
        assert Message.model_validate(message.model_dump()) == message
        shown = message.model_dump(mode="json", context=REFERENCE)
        image = shown["content"][1]
        assert image["data"] is None
        assert (image["media_type"], image["size"]) == ("image/png", len(data))
        assert base64.b64encode(data).decode()[:40] not in str(shown)
        assert "bytes" in repr(message.content[1])
        assert str(len(data)) in repr(message.content[1])
        assert base64.b64encode(data).decode()[:40] not in repr(message)

    def test_content_shapes(self) -> None:
        image = ImageBlock.from_bytes(png())
        only = UserMessage(content=[image])
        assert only.text == ""
        assert only.images == (image,)
        mixed = UserMessage(content=["a", image, TextBlock(text="b")])
        assert mixed.content[0] == TextBlock(text="a")
        assert mixed.text == "a\nb"
        assert mixed.shown() == f"a {image.reference} b"
        assert UserMessage(content="plain").images == ()
        with pytest.raises(ValidationError, match="at least 1 item"):
            UserMessage(content=[])
        with pytest.raises(ValidationError, match="valid tuple"):
            UserMessage(content=5)  # type: ignore[arg-type]

    def test_an_output_without_images_dumps_as_before(self) -> None:
        plain = FunctionCallOutputItem(call_id="c", output="3")
        assert "images" not in plain.model_dump_json()
        image = ImageBlock.from_bytes(png())
        with_image = FunctionCallOutputItem(call_id="c", output="", images=(image,))
        back = FunctionCallOutputItem.model_validate_json(with_image.model_dump_json())
        assert back.images == (image,)


class TestRefusedBeforeTheHistoryChanges:
    async def test_run_loop_refuses_a_model_that_takes_no_image(self) -> None:
        provider = Vision(NO_IMAGES)
        context = ModelContext()
        context.append(UserMessage(content="earlier"))
        before = list(context.items)
        image = ImageBlock.from_bytes(png())
        async with Runtime(providers={"eyes": provider}) as runtime:
            recorder = EventRecorder(runtime.bus)
            with pytest.raises(ImageNotSupported) as raised:
                runtime.run_loop(
                    "a",
                    UserMessage(content=["look", image]),
                    InferenceInput(model="eyes:blind", context=context),
                )
            assert runtime.loops() == []
        error = raised.value
        assert (error.model, error.capability) == (
            "eyes:blind",
            "images in user messages",
        )
        assert error.block == f"content[1] {image.reference}"
        assert "'eyes:blind' does not take images in user messages" in str(error)
        assert context.items == before
        assert recorder.events == []
        assert provider.scripted.requests == []

    @pytest.mark.parametrize(
        ("support", "block", "lacking"),
        [
            (
                ImageSupport(urls=False),
                ImageBlock.from_url("https://example.com/a.png"),
                "images by URL",
            ),
            (
                ImageSupport(max_bytes=100),
                ImageBlock.from_bytes(png(payload=b"y" * 200)),
                "images over 100 bytes",
            ),
        ],
    )
    async def test_each_capability_is_named(
        self, support: ImageSupport, block: ImageBlock, lacking: str
    ) -> None:
        async with Runtime(providers={"eyes": Vision(support)}) as runtime:
            with pytest.raises(ImageNotSupported, match=lacking) as raised:
                runtime.run_loop("a", UserMessage(content=[block]), _inference())
        assert raised.value.capability == lacking

    async def test_a_model_that_takes_them_gets_the_same_bytes(self) -> None:
        provider = Vision(ImageSupport())
        image = ImageBlock.from_bytes(png(payload=b"z" * 1000))
        async with Runtime(providers={"eyes": provider}) as runtime:
            loop_id = runtime.run_loop(
                "a", UserMessage(content=["look", image]), _inference()
            )
            result = await runtime.wait(loop_id)
        assert result.outcome is Outcome.answered
        sent = provider.scripted.requests[0].context.items[0]
        assert isinstance(sent, UserMessage)
        assert sent.images[0].data == image.data
        assert set(provider.asked) == {"eyes:m"}

    async def test_a_rewrite_adding_an_image_fails_the_loop_with_nothing_appended(
        self,
    ) -> None:
        """A handler's rewrite is checked where the message enters: the loop
        fails, ends idle with the error published, and the context is as it was."""
        image = ImageBlock.from_bytes(png())

        def add_image(pending: PendingTransition) -> Rewrite | None:
            if pending.trigger is Trigger.start:
                return Rewrite(
                    payload=UserMessage(content=["now with a picture", image])
                )
            return None

        provider = Vision(NO_IMAGES)
        inference = _inference()
        async with Runtime(providers={"eyes": provider}) as runtime:
            loop_id = runtime.run_loop("a", "hello", inference, add_image)
            result = await runtime.wait(loop_id)
        assert result.outcome is Outcome.failed
        assert result.error is not None
        assert result.error.type == "ImageNotSupported"
        assert f"content[1] {image.reference} was refused" in result.error.message
        assert inference.context.items == []
        assert provider.scripted.requests == []
        assert result.states[-1] == "idle"

    async def test_steering_with_an_image_is_refused_at_the_call(self) -> None:
        started: list[int] = []
        release: list[int] = []

        @tool
        async def wait_here() -> str:
            """Waits for the test."""
            started.append(1)
            await wait_until(lambda: bool(release))
            return "ok"

        provider = Vision(
            ImageSupport(user_messages=False),
            calls(call("wait_here", call_id="w")),
            text("done"),
        )
        inference = _inference(wait_here)
        async with Runtime(providers={"eyes": provider}) as runtime:
            loop_id = runtime.run_loop("a", "go", inference)
            await wait_until(lambda: bool(started))
            image = ImageBlock.from_bytes(png())
            for queue in (runtime.steer, runtime.follow_up):
                with pytest.raises(ImageNotSupported, match="images in user messages"):
                    queue(loop_id, UserMessage(content=["also this", image]))
            runtime.steer(loop_id, "text is fine")
            release.append(1)
            result = await runtime.wait(loop_id)
        assert result.outcome is Outcome.answered
        users = [i for i in inference.context.items if isinstance(i, UserMessage)]
        assert [u.content for u in users] == ["go", "text is fine"]

    async def test_a_block_built_without_validation_is_checked_again(self) -> None:
        forged = ImageBlock.model_construct(
            type="image",
            data=JPEG,
            media_type="image/png",
            url=None,
            digest="sha256:0",
            size=3,
        )
        message = UserMessage.model_construct(type="user_message", content=(forged,))
        inference = _inference()
        async with Runtime(providers={"eyes": Vision(ImageSupport())}) as runtime:
            with pytest.raises(
                TypeError,
                match=r"message.content\[0\] is not a valid image: the data is a JPEG image, not image/png as claimed",
            ):
                runtime.run_loop("a", message, inference)
            loop_id = runtime.run_loop(
                "b",
                "hi",
                inference,
                lambda p: (
                    Rewrite(payload=message) if p.trigger is Trigger.start else None
                ),
            )
            result = await runtime.wait(loop_id)
        assert result.outcome is Outcome.failed
        assert result.error is not None
        assert (
            "content[0] is not a valid image: the data is a JPEG image"
            in result.error.message
        )
        assert inference.context.items == []


class TestToolImages:
    async def test_a_tool_returning_images_reaches_the_next_request(self) -> None:
        shot = ImageBlock.from_bytes(png(4))
        chart = ImageBlock.from_bytes(GIF)

        @tool
        async def screenshot() -> ImageBlock:
            """Takes a screenshot."""
            return shot

        @tool
        async def plot() -> ToolResult:
            """Plots."""
            return ToolResult(output="a chart of sales", images=[chart, shot])

        provider = Vision(
            ImageSupport(),
            calls(call("screenshot", call_id="s"), call("plot", call_id="p")),
            text("seen"),
        )
        inference = _inference(screenshot, plot)
        async with Runtime(providers={"eyes": provider}) as runtime:
            recorder = EventRecorder(runtime.bus, ["function_call.completed"])
            result = await runtime.wait(runtime.run_loop("a", "show me", inference))
        assert result.outcome is Outcome.answered
        outputs = {
            i.call_id: i
            for i in provider.scripted.requests[1].context.items
            if isinstance(i, FunctionCallOutputItem)
        }
        assert (outputs["s"].output, outputs["s"].images) == ("", (shot,))
        assert (outputs["p"].output, outputs["p"].images) == (
            "a chart of sales",
            (chart, shot),
        )
        assert outputs["p"].images[1].data == shot.data
        completed = [e for e in recorder.events if isinstance(e, FunctionCallCompleted)]
        assert sorted(len(e.output.images) for e in completed) == [1, 2]

    async def test_images_that_are_no_blocks_make_an_error_output(self) -> None:
        @tool
        async def broken() -> ToolResult:
            """Returns what it should not."""
            return ToolResult.model_construct(
                output="x",
                is_error=False,
                terminate=False,
                images=["not an image"],  # type: ignore[arg-type]
            )

        provider = Vision(
            ImageSupport(), calls(call("broken", call_id="b")), text("ok")
        )
        inference = _inference(broken)
        async with Runtime(providers={"eyes": provider}) as runtime:
            result = await runtime.wait(runtime.run_loop("a", "go", inference))
        assert result.outcome is Outcome.answered
        out = next(
            i for i in inference.context.items if isinstance(i, FunctionCallOutputItem)
        )
        assert out.is_error
        assert out.images == ()
        assert out.output == "tool 'broken' returned str as images, not ImageBlocks"

    async def test_a_paused_loop_with_images_resumes(self) -> None:
        image = ImageBlock.from_bytes(png())

        @tool(needs_approval=True)
        async def look() -> ImageBlock:
            """Looks."""
            return image

        provider = Vision(
            ImageSupport(), calls(call("look", call_id="l")), text("seen")
        )
        inference = _inference(look)
        async with Runtime(providers={"eyes": provider}) as runtime:
            loop_id = runtime.run_loop("a", UserMessage(content=[image]), inference)
            await wait_until(lambda: runtime.get(loop_id).status is LoopStatus.paused)
            from agentfsm import Proceed

            runtime.resume(loop_id, Proceed())
            result = await runtime.wait(loop_id)
        assert result.outcome is Outcome.answered
        first, *_, last = inference.context.items
        assert isinstance(first, UserMessage)
        assert first.images == (image,)
        out = inference.context.items[2]
        assert isinstance(out, FunctionCallOutputItem)
        assert out.images == (image,)
        assert last.type == "model_message"


class TestReferences:
    def test_a_reference_carries_what_finds_its_bytes(self) -> None:
        data = png(payload=b"r" * 100)
        block = ImageBlock.from_bytes(data)
        ref = block.as_reference()
        assert ref.is_reference
        assert not block.is_reference
        assert (ref.data, ref.digest, ref.size, ref.media_type) == (
            None,
            block.digest,
            len(data),
            "image/png",
        )
        assert ImageBlock.model_validate_json(ref.model_dump_json()) == ref
        assert ref.with_data(data) == block
        with pytest.raises(ValidationError, match="do not match the digest"):
            ref.with_data(png(payload=b"s" * 100))
        assert ref.as_reference() is ref

    @pytest.mark.parametrize(
        ("given", "says"),
        [
            ({"digest": "sha256:00", "media_type": "image/png", "size": 3}, "64 hex"),
            ({"digest": "sha256:" + "0" * 64, "size": 3}, "needs its media_type"),
            (
                {"digest": "sha256:" + "0" * 64, "media_type": "image/png", "size": 0},
                "between 1",
            ),
        ],
    )
    def test_an_incomplete_reference_is_refused(
        self, given: dict[str, object], says: str
    ) -> None:
        with pytest.raises(ValidationError, match=says):
            ImageBlock(**given)  # type: ignore[arg-type]

    async def test_a_reference_never_reaches_a_model(self) -> None:
        """A context holding a reference whose bytes were not read back fails
        the request, naming the image, rather than sending nothing in its place."""
        from tests.http_mock import MockAPI
        from tests.test_images_providers import chat_provider

        ref = ImageBlock.from_bytes(png()).as_reference()
        inference = InferenceInput(model="openai-chat:gpt-4.1", context=ModelContext())

        def with_reference(pending: PendingTransition) -> Rewrite | None:
            # (A caller's own reference is refused at run_loop; a handler's
            # enters, as a workflow's carried one does.)
            if pending.trigger is Trigger.start:
                return Rewrite(payload=UserMessage(content=["see", ref]))
            return None

        async with (
            MockAPI() as api,
            Runtime(providers={"openai-chat": chat_provider(api)}) as runtime,
        ):
            result = await runtime.wait(
                runtime.run_loop("a", "hi", inference, with_reference)
            )
        assert result.outcome is Outcome.failed
        assert result.error is not None
        assert result.error.type == "ImageMissing"
        assert ref.reference in result.error.message
        assert api.bodies == []


async def test_a_traced_loop_refuses_what_its_provider_would() -> None:
    """The traced view of a provider says where its model takes images, so a
    traced loop refuses a rewrite's image before the history changes too."""
    from opentelemetry.sdk.trace import TracerProvider

    from agentfsm.otel import OpenTelemetry

    image = ImageBlock.from_bytes(png())

    def add_image(pending: PendingTransition) -> Rewrite | None:
        if pending.trigger is Trigger.start:
            return Rewrite(payload=UserMessage(content=[image]))
        return None

    provider = Vision(NO_IMAGES)
    inference = _inference()
    instrument = OpenTelemetry(tracer_provider=TracerProvider())
    async with Runtime(
        providers={"eyes": provider}, extensions=[instrument]
    ) as runtime:
        result = await runtime.wait(runtime.run_loop("a", "hi", inference, add_image))
    assert result.error is not None
    assert result.error.type == "ImageNotSupported"
    assert inference.context.items == []
    assert provider.scripted.requests == []


class TestAdversarialInputs:
    async def test_a_list_of_images_and_text_is_a_tool_s_result(self) -> None:
        first, second = ImageBlock.from_bytes(png(1)), ImageBlock.from_bytes(png(2))

        @tool
        async def pictures() -> list[object]:
            """Two pictures and their captions."""
            return [first, "the first", second, TextBlock(text="the second")]

        @tool
        async def mixed() -> list[object]:
            """An image beside a number."""
            return [first, 5]

        provider = Vision(
            ImageSupport(),
            calls(call("pictures", call_id="p"), call("mixed", call_id="m")),
            text("ok"),
        )
        inference = _inference(pictures, mixed)
        async with Runtime(providers={"eyes": provider}) as runtime:
            await runtime.wait(runtime.run_loop("a", "go", inference))
        outs = {
            i.call_id: i
            for i in inference.context.items
            if isinstance(i, FunctionCallOutputItem)
        }
        assert (outs["p"].output, outs["p"].images) == (
            "the first\nthe second",
            (first, second),
        )
        assert outs["m"].is_error
        assert "holding a int" in outs["m"].output

    async def test_a_tool_image_that_lies_is_an_error_output(self) -> None:
        """A block built without validation, or a wrapper's `model_copy` that
        changed the bytes but not the digest, never reaches the context."""
        real = ImageBlock.from_bytes(png(3))
        forged = ImageBlock.model_construct(
            type="image",
            data=b"%PDF-1.7",
            media_type="image/png",
            url=None,
            digest=None,
            size=None,
        )
        stale = real.model_copy(update={"data": png(4)})

        def returning(block: ImageBlock, name: str) -> object:
            async def function() -> ToolResult:
                return ToolResult.model_construct(
                    output="", is_error=False, terminate=False, images=(block,)
                )

            function.__name__ = function.__doc__ = name
            return tool(function)

        tools = [returning(forged, "forged"), returning(stale, "stale")]
        provider = Vision(
            ImageSupport(),
            calls(call("forged", call_id="f"), call("stale", call_id="s")),
            text("ok"),
        )
        inference = _inference(*tools)
        async with Runtime(providers={"eyes": provider}) as runtime:
            await runtime.wait(runtime.run_loop("a", "go", inference))
        outs = {
            i.call_id: i
            for i in inference.context.items
            if isinstance(i, FunctionCallOutputItem)
        }
        assert outs["f"].is_error
        assert "no PNG, JPEG, GIF or WebP image" in outs["f"].output
        assert outs["s"].is_error
        assert "do not match the digest" in outs["s"].output
        assert outs["f"].images == outs["s"].images == ()

    async def test_a_caller_s_reference_without_bytes_is_refused(self) -> None:
        ref = ImageBlock.from_bytes(png()).as_reference()
        inference = _inference()
        async with Runtime(providers={"eyes": Vision(ImageSupport())}) as runtime:
            with pytest.raises(
                ValueError, match=r"content\[1\] is \[image: .*by reference"
            ):
                runtime.run_loop("a", UserMessage(content=["see", ref]), inference)
        assert inference.context.items == []

    def test_a_url_with_a_lone_surrogate_is_refused(self) -> None:
        with pytest.raises(ValidationError, match="lone surrogate"):
            ImageBlock.from_url("https://example.com/\udcff.png")

    def test_anthropic_s_limit_is_on_the_base64(self) -> None:
        from agentfsm.providers.anthropic import IMAGE_SUPPORT

        fits = ImageBlock.from_bytes(b"\x89PNG\r\n\x1a\n" + bytes(3_932_160 - 8))
        over = ImageBlock.from_bytes(b"\x89PNG\r\n\x1a\n" + bytes(3_932_160 - 7))
        assert len(base64.b64encode(fits.data or b"")) <= 5 * 1024 * 1024
        assert IMAGE_SUPPORT.lacking(fits) is None
        assert IMAGE_SUPPORT.lacking(over) == "images over 3,932,160 bytes"

    def test_the_ui_s_rewrite_keeps_the_blocks_order(self) -> None:
        from agentfsm.ui._actions import _rewritten

        a, b = ImageBlock.from_bytes(png(1)), ImageBlock.from_bytes(png(2))
        message = UserMessage(content=[a, "caption a", b, "caption b"])
        # (Its images by reference: the runtime applying the request puts the
        # paused message's own back.)
        a, b = a.as_reference(), b.as_reference()
        unchanged = _rewritten(message, message.text, 7)
        assert unchanged.content == (
            a,
            TextBlock(text="caption a"),
            b,
            TextBlock(text="caption b"),
        )
        edited = _rewritten(message, "one caption", 7)
        assert edited.content == (a, TextBlock(text="one caption"), b)

    async def test_a_loop_paused_at_its_start_stores_its_image_once(
        self, tmp_path: Path
    ) -> None:
        """The record and the events of a loop paused before its message
        entered the context refer to the image; its bytes are one blob."""
        import sqlite3

        from agentfsm import Pause
        from agentfsm.store import SQLiteStore

        data = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 600
        chunk = base64.b64encode(data)[3000:3040].decode()
        path = tmp_path / "loops.db"
        store = SQLiteStore(path, events=True)

        def pause_start(pending: PendingTransition) -> Pause | None:
            return Pause("look first") if pending.trigger is Trigger.start else None

        async with Runtime(
            providers={"eyes": Vision(ImageSupport())}, store=store
        ) as runtime:
            message = UserMessage(content=["what is it?", ImageBlock.from_bytes(data)])
            loop_id = runtime.run_loop("a", message, _inference(), pause_start)
            await wait_until(lambda: runtime.get(loop_id).status is LoopStatus.paused)
        # (The runtime's exit leaves the loop paused in the store, every commit landed.)
        db = sqlite3.connect(path)
        found = {
            f"{table}.{column}": db.execute(
                f"select count(*) from {table} where instr(cast({column} as text), ?)",
                (chunk,),
            ).fetchone()[0]
            for table, column in (
                ("log", "record"),
                ("events", "event"),
                ("blobs", "data"),
            )
        }
        assert found == {"log.record": 0, "events.event": 0, "blobs.data": 1}


async def test_a_request_s_reference_to_no_paused_image_is_refused(
    tmp_path: Path,
) -> None:
    """A stored rewrite refers to the paused message's images (what `agentfsm
    ui` stores); one referring to another image is refused with a note, and
    the loop stays paused, its message as it was."""
    from agentfsm import Pause
    from agentfsm.store import SQLiteStore
    from tests.test_requests import request_is
    from tests.test_ui_actions import stored_as

    image, other = ImageBlock.from_bytes(png(1)), ImageBlock.from_bytes(png(2))

    def pause_start(pending: PendingTransition) -> Pause | None:
        return Pause("look first") if pending.trigger is Trigger.start else None

    store = SQLiteStore(tmp_path / "loops.db")
    async with Runtime(
        providers={"eyes": Vision(ImageSupport())}, store=store, requests=3600.0
    ) as runtime:
        inference = _inference()
        loop_id = runtime.run_loop(
            "a", UserMessage(content=["look", image]), inference, pause_start
        )
        record = await stored_as(store, loop_id, LoopStatus.paused)
        assert record.pause is not None
        seq = record.pause.seq
        rewrite = Rewrite(payload=UserMessage(content=["look", other.as_reference()]))
        asked = await store.submit_request(
            loop_id, "resume", decision=rewrite, seq=seq, by="test"
        )
        runtime.poke_requests()
        refused = await request_is(store, asked.id, "refused")
        assert runtime.get(loop_id).status is LoopStatus.paused
    assert refused.note is not None
    assert f"{other.reference} is no image of the paused message" in refused.note
    assert inference.context.items == []


async def test_an_image_is_hashed_once_however_many_boundaries_check_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Validation hashes a block's bytes; run_loop, context_update and the
    tool path check it again without hashing it again (`ImageBlock.checked`),
    while a block no validation made is hashed when checked."""
    from agentfsm import _images

    hashed: list[int] = []
    digest_of = _images.digest_of

    def counting(data: bytes) -> str:
        hashed.append(len(data))
        return digest_of(data)

    monkeypatch.setattr(_images, "digest_of", counting)
    image = ImageBlock.from_bytes(png(payload=b"h" * 100))
    assert len(hashed) == 1

    @tool
    async def echo() -> ImageBlock:
        """Returns the image."""
        return image

    provider = Vision(ImageSupport(), calls(call("echo", call_id="e")), text("ok"))
    async with Runtime(providers={"eyes": provider}) as runtime:
        result = await runtime.wait(
            runtime.run_loop("a", UserMessage(content=[image]), _inference(echo))
        )
    assert result.outcome is Outcome.answered
    assert len(hashed) == 1
    copied = image.model_copy()
    assert copied.checked() == image
    assert len(hashed) == 2
