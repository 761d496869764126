"""The hot path's plain copies of names (states, triggers, event types) list
every member of what they copy."""

from __future__ import annotations

from typing import get_args

from agentfsm import LoopState
from agentfsm._bus import EventType
from agentfsm.events import EVENT_TYPES


def test_hot_path_state_constants_mirror_the_enums() -> None:
    """The loop's plain-class copies of the states and triggers list every member."""
    from agentfsm._loop import steps as _states
    from agentfsm.states import Trigger

    for mirror, enum in ((_states._S, LoopState), (_states._T, Trigger)):
        copied = {k: v for k, v in vars(mirror).items() if not k.startswith("_")}
        assert copied == dict(enum.__members__)


def test_hot_path_member_constants_are_their_members() -> None:
    """The module constants the hot path compares with are the members they
    name (`_DONE` is `LoopStatus.done`, ...)."""
    from agentfsm._loop import driver, loop
    from agentfsm.results import LoopStatus
    from agentfsm.states import Outcome

    expected = {
        (driver, "_DONE"): LoopStatus.done,
        (driver, "_ANSWERED"): Outcome.answered,
        (driver, "_STOPPED"): Outcome.stopped,
        (loop, "_RUNNING"): LoopStatus.running,
        (loop, "_DONE"): LoopStatus.done,
    }
    for (module, name), member in expected.items():
        assert getattr(module, name) is member, (module.__name__, name)


def test_loops_name_every_event_type() -> None:
    """The types loops publish by name are exactly the event classes' types."""
    assert set(get_args(EventType)) == set(EVENT_TYPES)
