"""Durable loops: where a loop's record, context, tool-call ledger, decisions and
events live.

```python
from agentfsm.store import SQLiteStore

async with Runtime(store=SQLiteStore("loops.db"), tools=[charge], handlers=[approve]) as runtime:
    await runtime.recover()          # continue what a crashed process left
    loop_id = runtime.run_loop(...)  # durable from its first transition
```

See [Durable loops][durable-loops] for what is stored, when, and what recovery does.
"""

from ._base import (
    CallRecord,
    Commit,
    CommitLog,
    EventArchive,
    Lease,
    LeaseLostError,
    Leases,
    Ledger,
    LoopDetachedError,
    LoopIdTakenError,
    LoopLockedError,
    LoopRequest,
    LoopStore,
    RequestNotices,
    Requests,
    SharedContexts,
    StoredLoop,
    StoredLoopSummary,
    StoreError,
    StoreSchemaError,
    StoreStatistics,
    UnreadableLoop,
)
from ._breaks import SharedBreakpoints, StoredBreak
from ._outline import LARGE, is_large
from ._sql import SQLStore
from .memory import MemoryStore
from .sqlite import SQLiteStore

__all__ = (
    "LARGE",
    "SQLStore",
    "is_large",
    "CallRecord",
    "Commit",
    "CommitLog",
    "EventArchive",
    "Lease",
    "LeaseLostError",
    "Leases",
    "Ledger",
    "LoopDetachedError",
    "LoopIdTakenError",
    "LoopLockedError",
    "LoopRequest",
    "LoopStore",
    "MemoryStore",
    "RequestNotices",
    "Requests",
    "SQLiteStore",
    "SharedBreakpoints",
    "SharedContexts",
    "StoreError",
    "StoreSchemaError",
    "StoreStatistics",
    "StoredBreak",
    "UnreadableLoop",
    "StoredLoop",
    "StoredLoopSummary",
)
