"""What a tool's `reconcile` function answers about a call in flight at a crash.

A durable loop whose process died during a tool call does not know whether the
call took effect. A tool made with `@tool(reconcile=fn)` lets recovery ask: it
calls `fn(idempotency_key, arguments)` before the loop would pause over the
call, and acts on the answer (see [Reconciling uncertain
calls][reconciling-uncertain-calls]):

- `Reconciled.ran(output)`: the call happened; `output` is recorded as its
  output (the ledger marks it settled by the reconcile function) and the call
  never runs again;
- `Reconciled.not_run()`: it did not happen; it runs now, with the same
  idempotency key;
- `None`: unknown; the loop pauses over it, as without `reconcile`.

Example:
    ```python
    from agentfsm import Reconciled, tool


    def find_charge(key: str, arguments: dict) -> Reconciled | None:
        charge = payments.find(idempotency_key=key)
        if charge is None:
            return Reconciled.not_run()
        return Reconciled.ran(f"charged {charge.cents} cents")


    @tool(reconcile=find_charge)
    async def charge(customer: str, cents: int) -> str:
        "Charge a customer."
        ...
    ```
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeAlias, final

from pydantic import BaseModel, ConfigDict, model_validator

from ._models import read_fields_fast
from .tools import ToolResult

__all__ = ("ReconcileFunction", "Reconciled")


@final
class Reconciled(BaseModel):
    """A reconcile function's answer: the call ran (with this result), or it
    did not. Make one with `Reconciled.ran` or `Reconciled.not_run`; a function
    that cannot tell returns None."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    outcome: Literal["ran", "not_run"]
    """Whether the call took effect before the crash."""
    result: ToolResult | None = None
    """The call's result, when it ran: what the loop's context gets as its
    output (`is_error` and `terminate` as a tool's own result would set them)."""

    @model_validator(mode="after")
    def _result_only_when_ran(self) -> Reconciled:
        if (self.outcome == "ran") != (self.result is not None):
            raise ValueError(
                "a Reconciled that ran holds the call's result, and one that did "
                "not run holds none: use Reconciled.ran(output) or "
                "Reconciled.not_run()"
            )
        return self

    @classmethod
    def ran(cls, output: Any) -> Reconciled:
        """The call happened and gave `output`: text as it is, a `ToolResult`
        as it is, anything else as JSON (as a tool's return value).

        Raises:
            ValueError: `output` cannot be serialized to JSON.
        """
        return cls(outcome="ran", result=ToolResult.of(output))

    @classmethod
    def not_run(cls) -> Reconciled:
        """The call did not happen: it runs now, with the same idempotency key."""
        return cls(outcome="not_run")


ReconcileFunction: TypeAlias = Callable[
    [str, dict[str, Any]], "Reconciled | Awaitable[Reconciled | None] | None"
]
"""`fn(idempotency_key, arguments)`, sync or async: `arguments` is the dict of
keyword arguments the tool's function would have been called with (validated
against its parameters). A sync function runs in a worker thread."""

read_fields_fast(globals())
