"""The one module that imports `transitions`.

At import it builds a core `transitions.Machine` from `agentfsm.states.TRANSITIONS`
(which checks the declaration), validates what transitions does not check
(unknown states, duplicate `(source, trigger)` pairs, states that cannot be
reached from `idle` or cannot get back to it), and compiles the frozen
`(state, trigger) -> dest` table that the loop runs. The hot path never runs
transitions' trigger machinery; it looks up `TABLE`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Final

from transitions import Machine

from .exceptions import ConfigurationError
from .states import ERROR_TRIGGERS, TRANSITIONS, LoopState, TransitionSpec, Trigger

__all__ = ("ALLOWED", "MACHINE", "TABLE", "build_machine", "compile_table")


def _sources(spec: TransitionSpec) -> list[LoopState]:
    source = spec["source"]
    return list(source) if isinstance(source, list) else [source]


def compile_table(
    specs: Iterable[TransitionSpec],
) -> Mapping[tuple[LoopState, Trigger], LoopState]:
    """Validate a declaration and compile it into a frozen lookup table.

    Raises:
        ConfigurationError: an unknown state or trigger, a duplicate
            `(source, trigger)` pair, or a state unreachable from `idle` or
            unable to return to it.
    """
    table: dict[tuple[LoopState, Trigger], LoopState] = {}
    for spec in specs:
        trigger, dest = spec["trigger"], spec["dest"]
        if not isinstance(trigger, Trigger):
            raise ConfigurationError(f"unknown trigger {trigger!r}")
        for state in (*_sources(spec), dest):
            if not isinstance(state, LoopState):
                raise ConfigurationError(f"unknown state {state!r} in {trigger}")
        for source in _sources(spec):
            if (source, trigger) in table:
                raise ConfigurationError(
                    f"duplicate transition ({source}, {trigger}): "
                    f"{table[source, trigger]} and {dest}"
                )
            table[source, trigger] = dest
    _check_reachability(table)
    return MappingProxyType(table)


def _closure(
    start: LoopState, edges: Mapping[LoopState, set[LoopState]]
) -> set[LoopState]:
    seen = {start}
    todo = [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _check_reachability(table: Mapping[tuple[LoopState, Trigger], LoopState]) -> None:
    forward: dict[LoopState, set[LoopState]] = {}
    backward: dict[LoopState, set[LoopState]] = {}
    for (source, trigger), dest in table.items():
        if trigger in ERROR_TRIGGERS:
            continue  # every state must be reachable along the normal edges
        forward.setdefault(source, set()).add(dest)
        backward.setdefault(dest, set()).add(source)
    states = set(LoopState)
    unreachable = states - _closure(LoopState.idle, forward)
    if unreachable:
        raise ConfigurationError(f"states unreachable from idle: {sorted(unreachable)}")
    stuck = states - _closure(LoopState.idle, backward)
    if stuck:
        raise ConfigurationError(f"states that cannot return to idle: {sorted(stuck)}")


def build_machine(specs: Iterable[TransitionSpec] = TRANSITIONS) -> Machine:
    """Build the core transitions machine (no model attached) from a declaration."""
    return Machine(
        model=None,
        states=list(LoopState),
        transitions=[dict(spec) for spec in specs],
        initial=LoopState.idle,
        auto_transitions=False,
    )


TABLE: Final = compile_table(TRANSITIONS)
"""Frozen `(state, trigger) -> dest`, compiled from `TRANSITIONS`."""

MACHINE: Final = build_machine(TRANSITIONS)
"""The transitions machine built from the same declaration (for tests and drawing)."""


def _allowed() -> Mapping[LoopState, Mapping[LoopState, Trigger]]:
    allowed: dict[LoopState, dict[LoopState, Trigger]] = {s: {} for s in LoopState}
    for (source, trigger), dest in TABLE.items():
        if trigger not in ERROR_TRIGGERS:
            allowed[source][dest] = trigger
    return MappingProxyType({s: MappingProxyType(d) for s, d in allowed.items()})


ALLOWED: Final = _allowed()
"""For each state, the destinations a rewrite may pick and the trigger leading there.

Outside the error edges each `(source, dest)` pair has a single trigger, so a
rewrite names its new edge by its destination.
"""


def draw_mermaid(title: str = "agentfsm loop") -> str:
    """Draw the machine as a mermaid `stateDiagram-v2`, drawn by transitions."""
    from transitions.extensions import GraphMachine

    class _Model:
        pass

    model = _Model()
    GraphMachine(
        model=model,
        states=list(LoopState),
        transitions=[dict(spec) for spec in TRANSITIONS],
        initial=LoopState.idle,
        auto_transitions=False,
        graph_engine="mermaid",
        title=title,
        show_conditions=False,
        show_state_attributes=False,
    )
    graph = model.get_graph()  # type: ignore[attr-defined]
    text = str(graph.draw(None))
    # transitions 0.9.3 writes the title as bare front matter; mermaid reads `title:`.
    text = text.replace(f"---\n{title}\n---", f"---\ntitle: {title}\n---", 1)
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"
