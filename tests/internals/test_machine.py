"""The compiled `(state, trigger) -> dest` table against the transitions declaration."""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import pytest

from agentfsm._machine import ALLOWED, MACHINE, TABLE, build_machine, compile_table
from agentfsm.exceptions import ConfigurationError
from agentfsm.states import (
    ERROR_TRIGGERS,
    TRANSITIONS,
    LoopState,
    TransitionSpec,
    Trigger,
)

S = LoopState
T = Trigger
ACTIVE = [s for s in LoopState if s is not LoopState.idle]


def machine_table() -> dict[tuple[LoopState, Trigger], LoopState]:
    """What the transitions `Machine` answers for every `(state, trigger)`."""
    answers: dict[tuple[LoopState, Trigger], LoopState] = {}
    for trigger in MACHINE.events:
        for state in LoopState:
            found = MACHINE.get_transitions(trigger, source=state)
            assert len(found) <= 1, f"{state} --{trigger}--> {[t.dest for t in found]}"
            if found:
                dest = found[0].dest
                assert dest is not None
                answers[state, Trigger(trigger)] = LoopState(dest)
    return answers


def closure(
    start: LoopState, edges: Mapping[LoopState, set[LoopState]]
) -> set[LoopState]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in edges.get(todo.pop(), set()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def normal_edges(*, reverse: bool = False) -> dict[LoopState, set[LoopState]]:
    edges: dict[LoopState, set[LoopState]] = {}
    for (source, trigger), dest in TABLE.items():
        if trigger not in ERROR_TRIGGERS:
            a, b = (dest, source) if reverse else (source, dest)
            edges.setdefault(a, set()).add(b)
    return edges


def without(*drop: tuple[Trigger, LoopState]) -> list[TransitionSpec]:
    """The real declaration minus the `(trigger, source)` specs in `drop`."""
    return [
        spec for spec in TRANSITIONS if (spec["trigger"], spec["source"]) not in drop
    ]


def test_table_equals_machine() -> None:
    """The compiled table answers exactly what the transitions machine answers."""
    assert dict(TABLE) == machine_table()


def test_machine_knows_every_state_and_trigger() -> None:
    """The transitions machine has every state and every trigger as an event."""
    assert set(MACHINE.states) == set(LoopState)
    assert set(MACHINE.events) == set(Trigger)


def test_table_holds_enum_members() -> None:
    """Keys and values of the table are `LoopState`/`Trigger` members, not plain strings."""
    for (source, trigger), dest in TABLE.items():
        assert type(source) is LoopState
        assert type(trigger) is Trigger
        assert type(dest) is LoopState


def test_table_is_frozen() -> None:
    """The table cannot be changed at run time."""
    table = cast("dict[tuple[LoopState, Trigger], LoopState]", TABLE)
    with pytest.raises(TypeError):
        table[S.idle, T.finish] = S.idle


def test_table_matches_design() -> None:
    """The normal edges are those of the table in DESIGN.md."""
    expected = {
        (S.idle, T.start): S.context_update,
        (S.context_update, T.infer): S.inference,
        (S.context_update, T.infer_streaming): S.inference_streaming,
        (S.inference, T.call_tools): S.function_call,
        (S.inference, T.answer): S.model_message,
        (S.inference_streaming, T.call_tools): S.function_call,
        (S.inference_streaming, T.answer): S.model_message,
        (S.function_call, T.infer): S.inference,
        (S.function_call, T.infer_streaming): S.inference_streaming,
        (S.function_call, T.steer): S.context_update,
        (S.function_call, T.stop): S.idle,
        (S.model_message, T.follow_up): S.context_update,
        (S.model_message, T.finish): S.idle,
    }
    normal = {k: v for k, v in TABLE.items() if k[1] not in ERROR_TRIGGERS}
    assert normal == expected


@pytest.mark.parametrize("state", list(LoopState), ids=str)
def test_state_reachable_from_idle(state: LoopState) -> None:
    """Every state can be reached from idle along normal (non-error) edges."""
    assert state in closure(S.idle, normal_edges())


@pytest.mark.parametrize("state", list(LoopState), ids=str)
def test_state_returns_to_idle(state: LoopState) -> None:
    """From every state, idle can be reached along normal (non-error) edges."""
    assert state in closure(S.idle, normal_edges(reverse=True))


@pytest.mark.parametrize("state", ACTIVE, ids=str)
@pytest.mark.parametrize("trigger", sorted(ERROR_TRIGGERS), ids=str)
def test_error_trigger_leads_to_idle(state: LoopState, trigger: Trigger) -> None:
    """abort, fail and cancel lead from every non-idle state to idle."""
    assert TABLE[state, trigger] is S.idle
    assert MACHINE.get_transitions(trigger, source=state)[0].dest == S.idle


@pytest.mark.parametrize("trigger", sorted(ERROR_TRIGGERS), ids=str)
def test_error_trigger_not_from_idle(trigger: Trigger) -> None:
    """An idle loop has no error edge: there is nothing to abort."""
    assert (S.idle, trigger) not in TABLE


def test_error_triggers() -> None:
    """The error triggers are exactly abort, fail and cancel."""
    assert frozenset({T.abort, T.fail, T.cancel}) == ERROR_TRIGGERS


ALLOWED_EXPECTED: dict[LoopState, dict[LoopState, Trigger]] = {
    S.idle: {S.context_update: T.start},
    S.context_update: {S.inference: T.infer, S.inference_streaming: T.infer_streaming},
    S.inference: {S.function_call: T.call_tools, S.model_message: T.answer},
    S.inference_streaming: {S.function_call: T.call_tools, S.model_message: T.answer},
    S.function_call: {
        S.inference: T.infer,
        S.inference_streaming: T.infer_streaming,
        S.context_update: T.steer,
        S.idle: T.stop,
    },
    S.model_message: {S.context_update: T.follow_up, S.idle: T.finish},
}


@pytest.mark.parametrize("state", list(LoopState), ids=str)
def test_allowed(state: LoopState) -> None:
    """ALLOWED maps each destination a rewrite may pick to the normal trigger leading there."""
    assert dict(ALLOWED[state]) == ALLOWED_EXPECTED[state]


def test_allowed_loses_no_edge() -> None:
    """No two normal triggers share a `(source, dest)`, so ALLOWED names every normal edge."""
    normal = [k for k in TABLE if k[1] not in ERROR_TRIGGERS]
    assert sum(len(d) for d in ALLOWED.values()) == len(normal)
    for state, dests in ALLOWED.items():
        for dest, trigger in dests.items():
            assert TABLE[state, trigger] is dest


def test_the_drivers_edges_are_the_table() -> None:
    """The driver's lookup (`_EDGES[source][trigger]`, the edge's `PathStep`)
    holds every edge of `TABLE`, nothing else, each as a step not rewritten."""
    from agentfsm._loop.driver import _EDGES, path_step
    from agentfsm.results import PathStep

    flat = {(s, t): step for s, by in _EDGES.items() for t, step in by.items()}
    assert flat.keys() == dict(TABLE).keys()
    for (source, trigger), step in flat.items():
        assert type(step) is PathStep
        assert step == PathStep(source, trigger, TABLE[source, trigger], None)
        assert path_step(source, trigger, step.dest) is step
    # A rewritten edge's step is made once, then shared.
    rewritten = path_step(
        S.context_update, T.infer_streaming, S.inference_streaming, S.inference
    )
    assert rewritten == PathStep(
        S.context_update, T.infer_streaming, S.inference_streaming, S.inference
    )
    assert rewritten is path_step(
        S.context_update, T.infer_streaming, S.inference_streaming, S.inference
    )


def test_compile_table_accepts_declaration() -> None:
    """Compiling the real declaration again gives the same table."""
    assert dict(compile_table(TRANSITIONS)) == dict(TABLE)


def test_build_machine_starts_idle() -> None:
    """A machine built from the declaration starts in idle and has no auto transitions."""
    machine = build_machine()
    assert machine.initial == S.idle
    assert "to_idle" not in machine.events


class TestCompileTableRejects:
    def test_duplicate_source_trigger(self) -> None:
        """A second destination for the same `(source, trigger)` is rejected."""
        specs: list[TransitionSpec] = [
            *TRANSITIONS,
            {
                "trigger": T.infer,
                "source": S.context_update,
                "dest": S.inference_streaming,
            },
        ]
        with pytest.raises(
            ConfigurationError, match=r"duplicate transition \(context_update, infer\)"
        ):
            compile_table(specs)

    def test_duplicate_within_list_source(self) -> None:
        """A list source repeating an existing `(source, trigger)` is rejected."""
        specs: list[TransitionSpec] = [
            *TRANSITIONS,
            {
                "trigger": T.stop,
                "source": [S.inference, S.function_call],
                "dest": S.idle,
            },
        ]
        with pytest.raises(ConfigurationError, match="duplicate transition"):
            compile_table(specs)

    def test_unknown_dest_state(self) -> None:
        """A destination that is not a `LoopState` is rejected."""
        bad = cast(
            "TransitionSpec",
            {"trigger": T.steer, "source": S.inference, "dest": "limbo"},
        )
        with pytest.raises(ConfigurationError, match="unknown state 'limbo'"):
            compile_table([*TRANSITIONS, bad])

    def test_unknown_source_state(self) -> None:
        """A source that is not a `LoopState` is rejected, also inside a list."""
        bad = cast(
            "TransitionSpec",
            {"trigger": T.steer, "source": [S.inference, "limbo"], "dest": S.idle},
        )
        with pytest.raises(ConfigurationError, match="unknown state 'limbo'"):
            compile_table([*TRANSITIONS, bad])

    def test_plain_string_state(self) -> None:
        """A plain string spelling a state is not a member, and is rejected."""
        bad = cast(
            "TransitionSpec",
            {"trigger": T.steer, "source": S.inference, "dest": "idle"},
        )
        with pytest.raises(ConfigurationError, match="unknown state"):
            compile_table([*TRANSITIONS, bad])

    def test_unknown_trigger(self) -> None:
        """A trigger that is not a `Trigger` is rejected."""
        bad = cast(
            "TransitionSpec", {"trigger": "jump", "source": S.inference, "dest": S.idle}
        )
        with pytest.raises(ConfigurationError, match="unknown trigger 'jump'"):
            compile_table([*TRANSITIONS, bad])

    def test_unreachable_state(self) -> None:
        """A state no normal edge leads to is rejected, even though error edges leave it."""
        specs = without(
            (T.infer_streaming, S.context_update), (T.infer_streaming, S.function_call)
        )
        with pytest.raises(
            ConfigurationError, match=r"unreachable from idle.*inference_streaming"
        ):
            compile_table(specs)

    def test_state_cannot_return_to_idle(self) -> None:
        """A state whose only way back to idle is an error edge is rejected."""
        specs = without((T.follow_up, S.model_message), (T.finish, S.model_message))
        with pytest.raises(
            ConfigurationError, match=r"cannot return to idle.*model_message"
        ):
            compile_table(specs)

    def test_empty_declaration(self) -> None:
        """A declaration with no edges leaves every active state unreachable."""
        with pytest.raises(ConfigurationError, match="unreachable"):
            compile_table([])
