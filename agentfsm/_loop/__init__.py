"""One loop: its record, the driver that takes its steps, and what each state does.

| module | what it holds |
|---|---|
| `loop` | `Loop`, the record of one loop, and its entry points from outside |
| `snapshot` | a live loop as its `agentfsm.record.LoopRecord` (`Runtime.snapshot`) |
| `driver` | the driver: intercept, commit, run the state; how a loop ends |
| `steps` | `Step`, what a state returns |
| `intercept` | handlers, decisions, rewrites, pauses |
| `states/` | one module per state |
| `turn` | what the states share about the current turn |
| `model_call` | one model request: provider, timeout, retries, stream |
| `tool_call` | one batch of tool calls: sequential or parallel, wrapped |
| `repair` | outputs for calls that have none, in the request only |
| `wrappers` | `(value, next)` chains |
"""

from .loop import Loop, current_loop_id

__all__ = ("Loop", "current_loop_id")
