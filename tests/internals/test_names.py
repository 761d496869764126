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


def test_loops_name_every_event_type() -> None:
    """The types loops publish by name are exactly the event classes' types."""
    assert set(get_args(EventType)) == set(EVENT_TYPES)
