"""Untrusted schemas and server commands (issue 25, findings 1 and 7).

1. A JSON schema never makes the host fetch a URL or read a file: every
   jsonschema validator is built by `agentfsm._jsonschema`, whose registry
   retrieves nothing, and a schema whose `$ref` does not resolve within it is
   refused up front (an MCP tool is left out; a structured output is refused
   when the request is made), never reaching the model.
7. An MCP server is named by a short label: its command line (a token in its
   arguments) and its URL's credentials reach no tool output, event, log line
   or exception message.

The hostile server is tests/mcp_hostile_server.py (in process, or over stdio).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import pytest
from pydantic import ValidationError
from structlog.typing import EventDict

from agentfsm import (
    ConfigurationError,
    FunctionCallOutputItem,
    InferenceInput,
    LoopResult,
    ModelContext,
    Runtime,
)
from agentfsm import _jsonschema as js
from agentfsm.mcp import MCPConnectionError, MCPToolset, mcp_tools
from agentfsm.mcp._options import reason
from agentfsm.testing import ScriptedProvider, call, calls, text
from tests.mcp_hostile_server import make_server

HOSTILE = Path(__file__).with_name("mcp_hostile_server.py")
SECRET = "tok-5f3c9a1e-SECRET"
FILE_SECRET = "FILE-CONTENT-7d41b2"


class Listener:
    """A TCP listener on 127.0.0.1 that counts the connections made to it.

    Each is accepted and closed at once, so that a client that does connect
    (the bug) fails fast instead of hanging; the count is final once the
    listener is closed: a connection not accepted yet waits in the backlog,
    and is counted then.
    """

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/x"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:  # the accept timed out: look at the stop flag again
                continue
            self.connections += 1
            conn.close()

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.setblocking(False)
        while True:
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                break
            self.connections += 1
            conn.close()
        self._sock.close()


def outputs(req: InferenceInput) -> list[FunctionCallOutputItem]:
    return [i for i in req.context.items if isinstance(i, FunctionCallOutputItem)]


async def run_loop(
    runtime: Runtime, tools: Any, **request: Any
) -> tuple[LoopResult, InferenceInput]:
    req = InferenceInput(model="s:m", context=ModelContext(), tools=tools, **request)
    return await runtime.wait(runtime.run_loop("a", "go", req)), req


def refused(logs: list[EventDict]) -> list[EventDict]:
    return [entry for entry in logs if entry["event"] == "mcp_tool_refused"]


# ------------------------------------------------------- the schema helper


class TestHelper:
    def test_local_references_resolve(self) -> None:
        """`$ref`s into the schema's own `$defs`, anchors and `$id`s work."""
        schema = {
            "$id": "urn:example:root",
            "$defs": {
                "text": {"type": "string"},
                "count": {"$anchor": "count", "type": "integer"},
                "flag": {"$id": "urn:example:flag", "type": "boolean"},
            },
            "properties": {
                "a": {"$ref": "#/$defs/text"},
                "b": {"$ref": "#count"},
                "c": {"$ref": "urn:example:flag"},
            },
        }
        check = js.validator(schema)
        assert js.errors(check, {"a": "x", "b": 1, "c": True}) == []
        found = js.errors(check, {"a": 1, "b": "x", "c": 2})
        assert sorted(e.message for e in found) == [
            "'x' is not of type 'integer'",
            "1 is not of type 'string'",
            "2 is not of type 'boolean'",
        ]

    @pytest.mark.parametrize(
        ("ref", "why"),
        [
            pytest.param(
                "http://169.254.169.254/latest/meta-data", "is outside", id="http"
            ),
            pytest.param("file:///etc/hostname", "is outside", id="file"),
            pytest.param("other.json#/x", "is outside", id="relative"),
            pytest.param("#/$defs/missing", "points to nothing", id="dangling"),
        ],
    )
    def test_a_reference_that_does_not_resolve_locally_is_refused(
        self, ref: str, why: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Refused up front, naming where and what, and nothing is opened."""
        import urllib.request

        opened: list[Any] = []
        monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: opened.append(a))
        schema = {"type": "object", "properties": {"x": {"$ref": ref}}}
        for draft in ("declared", "2020-12"):
            with pytest.raises(js.SchemaProblem) as caught:
                js.validator(schema, draft=draft)
            assert str(caught.value).startswith(f"$.properties.x.$ref: {ref!r} {why}")
            with pytest.raises(js.SchemaProblem, match=why):
                js.check(schema, draft=draft)
            with pytest.raises(js.SchemaProblem, match=why):
                js.validator(schema, draft=draft, checked=True)
        assert opened == []

    def test_a_validator_never_retrieves(self) -> None:
        """Even for a schema it did not check (jsonschema evolves a validator
        for each subschema it applies), the registry retrieves nothing."""
        check = js.validator({"type": "object"})
        with Listener() as listener:
            other = check.evolve(schema={"$ref": listener.url})
            with pytest.raises(js.SchemaProblem, match="does not resolve"):
                js.errors(other, 1)
        assert listener.connections == 0

    def test_the_declared_draft_is_walked(self) -> None:
        """A draft-07 schema's `definitions` and `items` array are followed."""
        schema = {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "definitions": {"a": {"type": "string"}},
            "properties": {"y": {"items": [{"$ref": "#/definitions/b"}]}},
        }
        with pytest.raises(js.SchemaProblem, match=r"^\$\.properties\.y\.items\[0\]"):
            js.check(schema)
        schema["definitions"]["b"] = {"type": "integer"}  # type: ignore[index]
        check = js.validator(schema)
        assert [e.message for e in js.errors(check, {"y": ["s"]})] == [
            "'s' is not of type 'integer'"
        ]

    @pytest.mark.parametrize(
        ("schema", "message"),
        [
            pytest.param({"type": "integr"}, r"^\$\.type: 'integr'", id="invalid"),
            pytest.param({"$schema": [1]}, r"^\$\.\$schema: \[1\]", id="schema-list"),
            pytest.param({"$dynamicRef": "#meta"}, "points to nothing", id="dynamic"),
            pytest.param([], "a schema is a JSON object", id="not-an-object"),
        ],
    )
    def test_an_invalid_schema_is_refused(self, schema: Any, message: str) -> None:
        with pytest.raises(js.SchemaProblem, match=message):
            js.check(schema)

    def test_deep_nesting_is_refused_not_a_recursion_error(self) -> None:
        schema: dict[str, Any] = {}
        inner = schema
        for _ in range(5000):
            inner["not"] = {}
            inner = inner["not"]
        with pytest.raises(js.SchemaProblem, match="nested too deeply"):
            js.check(schema)

    def test_a_schema_that_refers_to_itself_without_end(self) -> None:
        """Validating with it is a SchemaProblem, not a RecursionError."""
        check = js.validator({"$ref": "#"})
        with pytest.raises(js.SchemaProblem, match="refers to itself"):
            js.errors(check, 1)

    @pytest.mark.e2e
    def test_jsonschema_is_imported_only_when_a_schema_is_checked(self) -> None:
        """Importing agentfsm (its MCP module included) imports neither
        jsonschema nor referencing (~50 ms); checking a schema does."""
        code = (
            "import sys, agentfsm, agentfsm.mcp, agentfsm._loop.states.model_message\n"
            "assert not {'jsonschema', 'referencing'} & set(sys.modules)\n"
            "agentfsm.InferenceInput(model='s:m', context=agentfsm.ModelContext(),"
            " structured_output={'type': 'object'})\n"
            "assert {'jsonschema', 'referencing'} <= set(sys.modules)\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ------------------------------------------------------ structured output


def _object_with(x: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"x": x}, "required": ["x"]}


class TestStructuredOutput:
    def test_a_remote_reference_is_refused_when_the_request_is_made(self) -> None:
        """A dict schema with a remote `$ref` is a ValidationError naming it;
        the URL is never fetched."""
        with Listener() as listener, pytest.raises(ValidationError) as caught:
            InferenceInput(
                model="s:m",
                context=ModelContext(),
                structured_output=_object_with({"$ref": listener.url}),
            )
        assert listener.connections == 0
        [problem] = caught.value.errors()
        assert problem["loc"] == ("structured_output",)
        assert (
            f"not a valid JSON schema: $.properties.x.$ref: '{listener.url}' "
            "is outside the schema"
        ) in problem["msg"]

    def test_a_dangling_pointer_is_refused_when_the_request_is_made(self) -> None:
        """It never reaches the model (it failed the loop with jsonschema's
        private `PointerToNowhere` once the model had answered)."""
        with pytest.raises(ValidationError, match="points to nothing in the schema"):
            InferenceInput(
                model="s:m",
                context=ModelContext(),
                structured_output=_object_with({"$ref": "#/$defs/missing"}),
            )

    async def test_a_schema_changed_since_fails_the_loop_without_a_fetch(
        self,
    ) -> None:
        """A schema changed after the request was checked (a remote `$ref`
        added) fails the loop with a clear error, not a retry of the model's
        answer, and is not fetched."""
        provider = ScriptedProvider([text('{"x": 1}'), text('{"x": 2}')])
        with Listener() as listener:
            async with Runtime(providers={"s": provider}) as rt:
                req = InferenceInput(
                    model="s:m",
                    context=ModelContext(),
                    structured_output=_object_with({"type": "integer"}),
                )
                assert isinstance(req.structured_output, dict)
                req.structured_output["properties"]["x"] = {"$ref": listener.url}
                result = await rt.wait(rt.run_loop("a", "go", req))
        assert listener.connections == 0
        assert result.outcome == "failed"
        assert result.error is not None
        assert result.error.type == "StructuredOutputError"
        assert result.error.message.startswith(
            "structured_output is not a usable JSON schema: "
            f"$.properties.x.$ref: '{listener.url}' is outside the schema"
        )
        assert len(provider.requests) == 1  # no retry: no answer could fit

    async def test_local_references_validate_the_answer(self) -> None:
        """A schema with `$defs` works as before: a wrong answer is retried."""
        schema = {
            "$defs": {"n": {"type": "integer"}},
            **_object_with({"$ref": "#/$defs/n"}),
        }
        provider = ScriptedProvider([text('{"x": "one"}'), text('{"x": 1}')])
        async with Runtime(providers={"s": provider}) as rt:
            result, _ = await run_loop(rt, (), structured_output=schema)
        assert result.outcome == "answered"
        assert result.output == {"x": 1}
        assert len(provider.requests) == 2


# ------------------------------------------------- MCP, a hostile server


class TestMcpSchemas:
    async def test_a_remote_reference_is_never_fetched(
        self, log_output: list[EventDict]
    ) -> None:
        """A tool whose schema refers to a URL is left out, with a warning
        naming the server, the tool and the reference; the model's call of it
        is an unknown tool, and the URL gets no connection."""
        turn = calls(call("ref0", x=1), call("echo", text="hi"))
        provider = ScriptedProvider([turn, text("done")])
        with Listener() as listener:
            async with Runtime(providers={"s": provider}) as rt:
                tools = await mcp_tools(make_server([listener.url]))
                result, req = await run_loop(rt, tools)
        assert listener.connections == 0
        assert [t.name for t in tools] == ["echo", "die", "refuse"]
        assert result.outcome == "answered"
        unknown, echoed = outputs(req)
        assert unknown.is_error
        assert "ref0" in unknown.output
        assert (echoed.output, echoed.is_error) == ("hi", False)
        [warning] = refused(log_output)
        assert (warning["server"], warning["tool"]) == ("hostile", "ref0")
        assert warning["problem"].startswith(
            f"input schema $.properties.x.$ref: '{listener.url}' is outside the schema"
        )
        assert all(listener.url not in str(r.tools) for r in provider.requests)

    async def test_a_dangling_pointer_never_reaches_the_model(
        self, log_output: list[EventDict]
    ) -> None:
        async with Runtime():
            tools = await mcp_tools(make_server(["#/$defs/missing"]))
        assert "ref0" not in {t.name for t in tools}
        [warning] = refused(log_output)
        assert "'#/$defs/missing' points to nothing" in warning["problem"]

    async def test_include_naming_a_refused_tool_is_an_error(self) -> None:
        """A tool the user asked for by name is not silently dropped."""
        async with Runtime():
            with pytest.raises(ConfigurationError) as caught:
                await mcp_tools(
                    make_server(["file:///etc/hostname"]), include=["echo", "ref0"]
                )
        assert str(caught.value) == (
            "include names tool 'ref0' of MCP server hostile, which cannot be "
            "offered: its input schema $.properties.x.$ref: 'file:///etc/hostname' "
            "is outside the schema (other documents and files are never "
            "retrieved: put what it refers to under $defs)"
        )

    @pytest.mark.e2e
    async def test_over_stdio_a_url_gets_no_connection(
        self, log_output: list[EventDict]
    ) -> None:
        """A real server over stdio advertising a `$ref` to a local listener."""
        turn = calls(call("ref0", x=1))
        provider = ScriptedProvider([turn, text("done")])
        with Listener() as listener:
            async with Runtime(providers={"s": provider}) as rt:
                tools = await mcp_tools(f"{HOSTILE} --ref {listener.url}")
                result, _ = await run_loop(rt, tools)
        assert listener.connections == 0
        assert result.outcome == "answered"
        assert "ref0" not in {t.name for t in tools}
        [warning] = refused(log_output)
        assert (warning["server"], warning["tool"]) == (HOSTILE.name, "ref0")

    @pytest.mark.e2e
    # As a program runs: under the suite's warnings-as-errors, jsonschema's
    # warning about retrieving would itself fail the read and hide the content.
    @pytest.mark.filterwarnings("ignore::DeprecationWarning")
    async def test_over_stdio_a_files_content_never_reaches_the_context(
        self, tmp_path: Path
    ) -> None:
        """A `file://` reference is not read: the file's content is in no
        output, no request to the model and no event."""
        secret = tmp_path / "secret.json"
        secret.write_text(f'{{"const": "{FILE_SECRET}"}}', encoding="utf-8")
        log = tmp_path / "events.jsonl"
        provider = ScriptedProvider([calls(call("ref0", x="guess")), text("done")])
        async with Runtime(providers={"s": provider}, event_log=log) as rt:
            tools = await mcp_tools(f"{HOSTILE} --ref {secret.as_uri()}")
            result, req = await run_loop(rt, tools)
        events = log.read_text(encoding="utf-8")
        assert "ref0" in events  # the call is there, answered as an unknown tool
        assert FILE_SECRET not in events
        assert FILE_SECRET not in req.context.model_dump_json()
        assert all(FILE_SECRET not in r.model_dump_json() for r in provider.requests)
        assert result.outcome == "answered"
        assert "ref0" not in {t.name for t in tools}


# --------------------------------------------- MCP, the server's command


def _no_secret(*texts: str) -> None:
    for text_ in texts:
        assert SECRET not in text_


class TestMcpLabels:
    @pytest.mark.e2e
    async def test_a_token_in_the_command_is_never_repeated(
        self, tmp_path: Path, log_output: list[EventDict]
    ) -> None:
        """A server started with a token refuses a call, then dies mid-call:
        the outputs name it by its executable, and the token is in no output,
        request to the model, event or log line."""
        log = tmp_path / "events.jsonl"
        turn = calls(call("refuse"))
        provider = ScriptedProvider(
            [turn, calls(call("die")), calls(call("echo", text="x")), text("done")]
        )
        async with Runtime(providers={"s": provider}, event_log=log) as rt:
            tools = await mcp_tools(f"{sys.executable} {HOSTILE} --token {SECRET}")
            result, req = await run_loop(rt, tools)
        label = Path(sys.executable).name
        gone = f"MCP server {label} is not running: its process exited with code 3"
        assert result.outcome == "answered"
        assert [(o.output, o.is_error) for o in outputs(req)] == [
            (f"MCP server {label} refused the call: no, thank you", True),
            (gone, True),  # the call it died in
            (gone, True),  # the next: not started again
        ]
        _no_secret(
            tools.name,
            repr(tools),
            repr(tools[0]),
            log.read_text(encoding="utf-8"),
            repr(log_output),
            *(r.model_dump_json() for r in provider.requests),
        )

    @pytest.mark.parametrize(
        "server",
        [
            pytest.param(f"no-such-mcp-server-xyz --token {SECRET}", id="missing"),
            pytest.param(
                f"{sys.executable} -c 'import sys; sys.exit(3)' --token {SECRET}",
                id="exits",
            ),
            pytest.param(
                f"http://user:{SECRET}@127.0.0.1:9/mcp/{SECRET}?token={SECRET}",
                id="url",
            ),
        ],
    )
    async def test_a_server_that_does_not_connect(
        self, server: str, log_output: list[EventDict]
    ) -> None:
        """The connection error names the server without its token."""
        async with Runtime():
            with pytest.raises(MCPConnectionError) as caught:
                await mcp_tools(server)
        assert str(caught.value).startswith("cannot connect to MCP server ")
        _no_secret(str(caught.value), repr(log_output))

    def test_the_label(self) -> None:
        """A URL's host and port, a command's executable, or the given name."""
        url = f"https://user:{SECRET}@example.com:8443/mcp/{SECRET}?key={SECRET}"
        assert MCPToolset(url).name == "example.com:8443"
        assert MCPToolset(f"/opt/bin/node server.js --token {SECRET}").name == "node"
        assert MCPToolset(f"{HOSTILE} --token {SECRET}").name == HOSTILE.name
        named = MCPToolset(f"node s.js --token {SECRET}", name="files")
        assert named.name == "files"
        with pytest.raises(ConfigurationError, match="name must be a non-empty str"):
            MCPToolset("node s.js", name=" ")

    def test_a_command_that_does_not_parse(self) -> None:
        """shlex's error is shown without the command."""
        with pytest.raises(ConfigurationError, match="MCP server command") as caught:
            MCPToolset(f"server --token {SECRET} 'unclosed")
        _no_secret(str(caught.value))

    def test_urls_in_third_party_errors_are_cut_to_their_host(self) -> None:
        """An HTTP client's error quotes the URL: only its host and port stay."""
        error = RuntimeError(
            f"Client error '401' for url 'https://u:{SECRET}@h.example/mcp?k={SECRET}'"
        )
        assert reason(error) == (
            "RuntimeError: Client error '401' for url 'https://h.example/...'"
        )


@pytest.mark.parametrize(
    "schema",
    [
        pytest.param(
            {
                "$schema": "http://json-schema.org/draft-07/schema#",
                "dependencies": {
                    "a": {"type": "object"},
                    "b": ["a"],
                    "c": {"$ref": "#/definitions/d"},
                },
                "definitions": {"d": {"type": "object"}},
            },
            id="draft7-walk-crashes",
        ),
        pytest.param(
            {
                "$schema": "http://json-schema.org/draft-07/schema#",
                "dependencies": {"b": ["a"], "c": {"$ref": "http://127.0.0.1:9/x"}},
            },
            id="draft7-dependencies-after-a-list",
        ),
        pytest.param(
            {
                "$schema": "http://json-schema.org/draft-03/schema#",
                "type": [{"$ref": "http://127.0.0.1:9/x"}],
            },
            id="draft3-type",
        ),
    ],
)
def test_a_schema_the_drafts_walk_misses_is_refused(schema: dict[str, Any]) -> None:
    """A reference referencing's walk of an older draft never reaches (or any
    reference, when the walk crashes) is refused, never left for the
    validator to follow."""
    with pytest.raises(js.SchemaProblem, match="cannot be followed safely"):
        js.check(schema)


def test_a_schema_whose_walk_crashes_without_references_is_taken() -> None:
    """referencing's walk of this valid draft-07 schema crashes; it holds no
    reference, so there is nothing to refuse."""
    js.check(
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "dependencies": {"a": {"type": "object"}, "b": ["a"]},
        }
    )
