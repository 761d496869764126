"""Durable loops: where a loop's record, context and tool-call ledger live.

```python
from agentfsm.store import SQLiteStore

async with Runtime(store=SQLiteStore("loops.db"), tools=[charge], handlers=[approve]) as runtime:
    await runtime.recover()          # continue what a crashed process left
    loop_id = runtime.run_loop(...)  # durable from its first transition
```

See `docs/durability.md` for what is stored, when, and what recovery does.
"""

from ._base import (
    CallRecord,
    Commit,
    LoopIdTakenError,
    LoopLockedError,
    LoopStore,
    StoredLoop,
    StoreError,
    StoreSchemaError,
    StoreStatistics,
)
from .memory import MemoryStore
from .sqlite import SQLiteStore

__all__ = (
    "CallRecord",
    "Commit",
    "LoopIdTakenError",
    "LoopLockedError",
    "LoopStore",
    "MemoryStore",
    "SQLiteStore",
    "StoreError",
    "StoreSchemaError",
    "StoreStatistics",
    "StoredLoop",
)
