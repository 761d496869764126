"""`Agent`: a reusable, stateless definition; loops run on conversations."""

from __future__ import annotations

from typing import Any, Literal, assert_type

import anyio
import pytest

from agentfsm import (
    Agent,
    ConfigurationError,
    Conversation,
    FunctionProvider,
    InferenceInput,
    InferenceOutput,
    LoopFailedError,
    ModelContext,
    ModelMessageItem,
    NoRuntimeError,
    Outcome,
    Runtime,
    UserMessage,
    current_runtime,
)
from agentfsm.providers import split_model
from agentfsm.testing import RecordingHandler, ScriptedProvider, call, calls, text
from tests.helpers import add, wait_until


def _echo(request: InferenceInput) -> InferenceOutput:
    """Answers with every user message of the request's context, joined by `|`."""
    seen = [i.text for i in request.context.items if isinstance(i, UserMessage)]
    return text("|".join(seen))


def _answer(result: Any) -> str:
    assert result.outcome is Outcome.answered, result
    assert result.answer is not None
    content: str = result.answer.content
    return content


async def test_hello_world_with_a_scripted_model() -> None:
    """An agent runs on a provider object, under its name, with its instructions."""
    script = ScriptedProvider([text("Paris.")])
    agent = Agent(script, name="geo", instructions="Answer briefly.")
    with anyio.fail_after(10):
        result = await agent.run("What is the capital of France?")
    assert _answer(result) == "Paris."
    assert result.agent_id == "geo"
    [request] = script.requests
    assert request.context.instructions == "Answer briefly."
    # (the request's context is the loop's: the answer was appended after it)
    assert [getattr(i, "content", None) for i in request.context.items] == [
        "What is the capital of France?",
        "Paris.",
    ]


async def test_tools_from_plain_functions() -> None:
    """Plain functions become tools; the loop calls them and answers."""

    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    script = ScriptedProvider([calls(call("multiply", a=6, b=7)), text("42")])
    agent = Agent(script, tools=[multiply, add])
    assert [t.name for t in agent.tools] == ["multiply", "add"]
    with anyio.fail_after(10):
        result = await agent.run("6 * 7?")
    assert _answer(result) == "42"
    assert result.tool_calls == 1
    assert [t.name for t in script.requests[0].tools] == ["multiply", "add"]


async def test_a_conversation_carries_over_loops() -> None:
    """Each loop on a conversation sees what earlier loops on it appended."""
    agent = Agent(FunctionProvider(_echo))
    chat = Conversation()
    with anyio.fail_after(10):
        async with Runtime():
            first = await agent.run("My name is Ada.", conversation=chat)
            second = await agent.run("What is my name?", conversation=chat)
    assert _answer(first) == "My name is Ada."
    assert _answer(second) == "My name is Ada.|What is my name?"
    assert chat.loop_ids == [first.loop_id, second.loop_id]
    assert [type(i).__name__ for i in chat.items] == [
        "UserMessage",
        "ModelMessageItem",
        "UserMessage",
        "ModelMessageItem",
    ]


async def test_two_conversations_never_see_each_other() -> None:
    """Loops of one agent on two conversations, run at once, stay apart."""
    agent = Agent(FunctionProvider(_echo))
    alice, bob = Conversation(), Conversation()
    with anyio.fail_after(10):
        async with Runtime() as runtime:
            ids = [
                agent.start("I am Alice.", conversation=alice),
                agent.start("I am Bob.", conversation=bob),
            ]
            results = [await runtime.wait(i) for i in ids]
            ids = [
                agent.start("Who am I?", conversation=alice),
                agent.start("Who am I?", conversation=bob),
            ]
            results += [await runtime.wait(i) for i in ids]
    answers = [_answer(r) for r in results]
    assert answers == [
        "I am Alice.",
        "I am Bob.",
        "I am Alice.|Who am I?",
        "I am Bob.|Who am I?",
    ]
    assert "Bob" not in str([i.model_dump() for i in alice.items])
    assert "Alice" not in str([i.model_dump() for i in bob.items])


async def test_without_a_conversation_each_loop_starts_afresh() -> None:
    """Loops started with no conversation share nothing, and the agent keeps nothing."""
    agent = Agent(FunctionProvider(_echo), instructions="Echo.")
    with anyio.fail_after(10):
        async with Runtime():
            first = await agent.run("one")
            second = await agent.run("two")
    assert (_answer(first), _answer(second)) == ("one", "two")
    assert agent.request(ModelContext()).context.items == []


async def test_start_returns_at_once() -> None:
    """`start` returns the loop id while the loop still runs."""
    release = anyio.Event()

    async def slow(request: InferenceInput) -> InferenceOutput:
        await release.wait()
        return text("done")

    agent = Agent(FunctionProvider(slow))
    chat = Conversation()
    with anyio.fail_after(10):
        async with Runtime() as runtime:
            loop_id = agent.start("go", conversation=chat)
            assert chat.loop_ids == [loop_id]
            await wait_until(lambda: runtime.get(loop_id).state == "inference")
            release.set()
            assert _answer(await runtime.wait(loop_id)) == "done"


async def test_a_provider_object_serves_a_named_model() -> None:
    """With `provider=`, the model name goes out to that provider as it is; a
    provider object alone gets the agent's name (the scripted model ignores it)."""
    seen: list[str] = []

    def record(request: InferenceInput) -> InferenceOutput:
        seen.append(split_model(request.model)[1])
        return text("ok")

    provider = FunctionProvider(record)
    named = Agent("llama3", provider=provider, name="geo")
    alone = Agent(provider, name="geo")
    with anyio.fail_after(10):
        async with Runtime():
            for agent in (named, alone):
                assert _answer(await agent.run("hi")) == "ok"
    assert seen == ["llama3", "geo"]
    assert named.model.endswith(":llama3")


async def test_run_opens_a_runtime_when_none_is_current() -> None:
    """Outside `async with Runtime()`, `run` opens one for the call and closes it."""
    agent = Agent(ScriptedProvider([text("hi")]))
    with pytest.raises(NoRuntimeError):
        current_runtime()
    with anyio.fail_after(10):
        result = await agent.run("hello")
    assert _answer(result) == "hi"


async def test_an_agent_works_on_several_runtimes() -> None:
    """The provider object is registered with each runtime the agent uses."""
    agent = Agent(ScriptedProvider([text("hi")]))
    with anyio.fail_after(10):
        for _ in range(2):
            async with Runtime() as runtime:
                assert _answer(await agent.run("hello", runtime=runtime)) == "hi"


async def test_model_settings_reach_each_request() -> None:
    """Settings go out on every request; a forced tool is forced once, then auto."""
    seen: list[tuple[float | None, int | None, str | None]] = []
    script = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])

    async def record(request: InferenceInput) -> InferenceOutput:
        seen.append((request.temperature, request.seed, request.effective_tool_choice))
        return await script.complete(request)

    agent = Agent(
        FunctionProvider(record),
        tools=[add],
        model_settings={"temperature": 0.2, "seed": 7, "tool_choice": "add"},
    )
    assert agent.model_settings == {
        "temperature": 0.2,
        "seed": 7,
        "tool_choice": "add",
        "reset_tool_choice": "auto",
    }
    with anyio.fail_after(10):
        assert _answer(await agent.run("1+2?")) == "3"
    assert seen == [(0.2, 7, "add"), (0.2, 7, "auto")]


async def test_a_tool_forced_on_every_request() -> None:
    """`reset_tool_choice=None` (typed in `ModelSettings`) forces the tool on
    every request of the loop, not once."""
    seen: list[str | None] = []
    script = ScriptedProvider(
        [calls(call("add", a=1, b=2)), calls(call("add", a=3, b=3)), text("6")]
    )

    async def record(request: InferenceInput) -> InferenceOutput:
        seen.append(request.effective_tool_choice)
        return await script.complete(request)

    agent = Agent(
        FunctionProvider(record),
        tools=[add],
        model_settings={"tool_choice": "add", "reset_tool_choice": None},
    )
    assert agent.model_settings.get("reset_tool_choice") is None
    result = await agent.run("1+2, then 3+3", max_turns=2)
    assert seen == ["add", "add"]
    assert (result.outcome, result.reason) == (Outcome.stopped, "max_turns")


async def test_handlers_and_loop_options() -> None:
    """The agent's handlers see every transition; its options apply, per-run ones win."""
    handler = RecordingHandler()
    script = ScriptedProvider([calls(call("add", a=1, b=2))] * 2 + [text("3")])
    agent = Agent(script, tools=[add], handlers=[handler], max_turns=1)
    with anyio.fail_after(10):
        async with Runtime():
            stopped = await agent.run("1+2?")
            answered = await agent.run("1+2?", max_turns=5)
    assert (stopped.outcome, stopped.reason) == (Outcome.stopped, "max_turns")
    assert handler.triggers[:3] == ["start", "infer", "call_tools"]
    assert _answer(answered) == "3"
    assert answered.model_requests == 3


def test_start_without_a_runtime_says_what_to_do() -> None:
    agent = Agent(ScriptedProvider([text("hi")]))
    with pytest.raises(NoRuntimeError, match=r"agent.start\(\) needs a runtime"):
        agent.start("hello")


def test_run_sync_from_a_script() -> None:
    """`run_sync` runs a loop from code that is not async (asyncio and trio)."""
    agent = Agent(ScriptedProvider([text("hi")]))
    assert _answer(agent.run_sync("hello")) == "hi"
    assert _answer(agent.run_sync("hello", backend="trio")) == "hi"


async def test_a_failed_loop_raises() -> None:
    """`run` raises `LoopFailedError` for a failed loop (not an `ExceptionGroup`,
    on trio too, from the runtime it opens); `raise_on_failure=False` returns it."""
    agent = Agent(ScriptedProvider([]))  # its first request is past the script
    with anyio.fail_after(10):
        with pytest.raises(LoopFailedError, match="failed: ProviderError: ") as caught:
            await agent.run("hello")
        assert caught.value.result is not None
        assert caught.value.result.outcome is Outcome.failed
        assert caught.value.error.type == "ProviderError"
        async with Runtime():  # on the current runtime, likewise
            with pytest.raises(LoopFailedError):
                await agent.run("hello")
        result = await agent.run("hello", raise_on_failure=False)
    assert (result.outcome, result.answer) == (Outcome.failed, None)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_run_sync_raises_for_a_failed_loop(backend: Literal["asyncio", "trio"]) -> None:
    """The hello world (`run_sync(...).answer.content`) fails with the loop's error."""
    agent = Agent(ScriptedProvider([]))
    with pytest.raises(LoopFailedError, match="failed: ProviderError: "):
        agent.run_sync("hello", backend=backend).answer.content  # type: ignore[union-attr]  # noqa: B018
    result = agent.run_sync("hello", backend=backend, raise_on_failure=False)
    assert result.outcome is Outcome.failed


async def test_run_sync_inside_an_event_loop_is_refused() -> None:
    agent = Agent(ScriptedProvider([text("hi")]))
    with pytest.raises(ConfigurationError, match=r"use `await agent.run\(...\)`"):
        agent.run_sync("hello")


class TestDefinitionErrors:
    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            pytest.param(
                {"model": "gpt-4.1-mini"},
                "must be named 'provider:model'",
                id="no-prefix",
            ),
            pytest.param(
                {"model": FunctionProvider},
                "model must be a 'provider:model' name or a provider object",
                id="a-class",
            ),
            pytest.param(
                {"model_settings": {"temprature": 0.2}},
                r"unknown model settings: temprature \(known: [a-z_, ]*temperature",
                id="unknown-setting",
            ),
            pytest.param(
                {"model_settings": {"temperature": 5}},
                "agent 'agent': temperature: Input should be less than or equal to 2",
                id="bad-setting",
            ),
            pytest.param(
                {"tools": add},
                r"tools must be a list of tools, e.g. tools=\[add\]",
                id="one-tool",
            ),
            pytest.param(
                {"tools": add.function},
                r"tools must be a list of tools, e.g. tools=\[add\]",
                id="one-function",
            ),
            pytest.param(
                {"tools": "add"},
                "agent 'agent': tools must be a list of tools, got str$",
                id="a-str",
            ),
            pytest.param(
                {"tools": {add}},
                "tools must be a list of tools, got set$",
                id="a-set",
            ),
            pytest.param(
                {"tools": [add], "model_settings": {"tool_choice": "ad"}},
                r"agent 'agent': tool_choice 'ad' is not one of its tools "
                r"\(its tools: 'add'; or 'auto', 'required', 'none'\)",
                id="tool-choice-unknown-tool",
            ),
            pytest.param(
                {"model_settings": {"tool_choice": "add"}},
                r"tool_choice 'add' is not one of its tools \(its tools: none;",
                id="tool-choice-no-tools",
            ),
            pytest.param(
                {"model_settings": {"tool_choice": "required"}},
                "tool_choice 'required' forces a tool call, but the agent has no tools",
                id="required-no-tools",
            ),
            pytest.param(
                {"tools": [add, add]}, "two tools are named 'add'", id="duplicate-tool"
            ),
            pytest.param(
                {"tools": ["add"]}, "a tool must be a Tool or a function", id="str-tool"
            ),
            pytest.param({"max_turns": 0}, "max_turns must be in", id="bad-option"),
            pytest.param({"handlers": [1]}, "handler 1 is not callable", id="handler"),
            pytest.param({"name": ""}, "name must be a non-empty str", id="name"),
            pytest.param(
                {"model": "", "provider": FunctionProvider(_echo)},
                "with provider=, model must be the name of the model",
                id="provider-without-a-model-name",
            ),
            pytest.param(
                {"model": "m", "provider": FunctionProvider},
                "provider must be a provider object",
                id="provider-a-class",
            ),
        ],
    )
    def test_mistakes_fail_when_the_agent_is_defined(
        self, kwargs: dict[str, Any], message: str
    ) -> None:
        """Each mistake is a `ConfigurationError` naming it, before any loop runs."""
        kwargs = {"model": "scripted:m", **kwargs}
        with pytest.raises(ConfigurationError, match=message):
            Agent(**kwargs)

    async def test_a_conversation_must_be_one(self) -> None:
        agent = Agent(ScriptedProvider([text("hi")]))
        async with Runtime():
            with pytest.raises(ConfigurationError, match="must be a Conversation"):
                agent.start("hi", conversation=ModelContext())  # type: ignore[arg-type]


def test_the_answer_item_is_the_models() -> None:
    """The agent adds nothing of its own to the items (a plain `ModelMessageItem`)."""
    chat = Conversation()
    Agent(ScriptedProvider([text("hi")])).run_sync("hello", conversation=chat)
    assert isinstance(chat.items[-1], ModelMessageItem)
    assert repr(chat) == "Conversation(items=2, loops=1)"


async def test_output_type_parses_the_answer() -> None:
    """`output_type` is the request's structured output; the result holds the model."""
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    script = ScriptedProvider([text('{"name": "Paris", "country": "France"}')])
    agent = Agent(script, output_type=City)
    assert_type(agent, Agent[City])
    with anyio.fail_after(10):
        result = await agent.run("The capital of France?")
    assert_type(result.output, City | None)  # (mypy checks it; a no-op here)
    assert result.output == City(name="Paris", country="France")
    assert script.requests[0].structured_output is City


async def test_a_plain_answers_output_is_its_text() -> None:
    """Without `output_type`, `result.output` is the answer's text, a `str`."""
    agent = Agent(ScriptedProvider([text("Paris.")]))
    assert_type(agent, Agent[str])
    with anyio.fail_after(10):
        result = await agent.run("The capital of France?")
    assert_type(result.output, str | None)
    assert result.answer is not None
    assert result.output == result.answer.content == "Paris."


async def test_a_json_schemas_output_is_json_data() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    agent = Agent(ScriptedProvider([text('{"n": 3}')]), output_type=schema)
    assert_type(agent, Agent[Any])
    with anyio.fail_after(10):
        result = await agent.run("Three?")
    assert result.output == {"n": 3}


async def test_a_loop_without_an_answer_has_no_output() -> None:
    agent = Agent(ScriptedProvider([RuntimeError("down")]))
    with anyio.fail_after(10):
        result = await agent.run("hi", raise_on_failure=False)
    assert (result.outcome, result.answer, result.output) == (
        Outcome.failed,
        None,
        None,
    )


async def test_none_continues_a_conversation() -> None:
    """`message=None` runs on what the conversation holds (it must end with a user message)."""
    agent = Agent(FunctionProvider(_echo))
    chat = Conversation(ModelContext(items=[UserMessage(content="queued")]))
    with anyio.fail_after(10):
        result = await agent.run(None, conversation=chat)
    assert _answer(result) == "queued"
    with pytest.raises(ConfigurationError, match="must end with a user message"):
        await agent.run(None, conversation=chat)  # it ends with the answer now


async def test_instructions_on_a_shared_conversation() -> None:
    """Each agent's loop runs with its instructions; one without keeps the context's."""
    seen: list[str | None] = []

    def record(request: InferenceInput) -> InferenceOutput:
        seen.append(request.context.instructions)
        return text("ok")

    provider = FunctionProvider(record)
    chat = Conversation(ModelContext(instructions="Be kind."))
    with anyio.fail_after(10):
        async with Runtime():
            await Agent(provider).run("a", conversation=chat)
            await Agent(provider, instructions="Be brief.").run("b", conversation=chat)
            await Agent(provider, instructions="Be French.").run("c", conversation=chat)
    assert seen == ["Be kind.", "Be brief.", "Be French."]
