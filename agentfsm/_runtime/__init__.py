"""The runtime: the task group loops run in, its workers, the backend, the ids."""

from .runtime import Runtime, current_runtime, run_loop

__all__ = ("Runtime", "current_runtime", "run_loop")
