"""JAX's persistent compilation cache, kept in the engine's cache directory, and a count of
what warm-up compiled and what it found there.

With the cache, a second start of the same configuration loads its executables from disk
instead of compiling them. JAX keys entries by the program, its compile options and the
backend, so a changed model, bucket or JAX version compiles afresh; the directory is trusted
code (never share it with users you do not trust).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

MAX_CACHE_BYTES = 4 << 30  # least recently used entries go beyond this

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # fires for cache loads too
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def enable(path: Path) -> bool:
    """Points JAX's persistent cache at `path` (every compiled program is kept). Returns
    False, leaving JAX as it is, when this process already uses another directory."""
    current = jax.config.jax_compilation_cache_dir
    if current and Path(current).resolve() != path.resolve():
        logger.warning("JAX already caches compilations in %s; not using %s", current, path)
        return False
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", MAX_CACHE_BYTES)
    return True


@dataclasses.dataclass
class CompileCounter:
    """Within `with`: counts the programs JAX compiled or loaded (`programs`; its compile
    event fires for both) and those found in the persistent cache (`cache_hits`)."""

    programs: int = 0
    cache_hits: int = 0

    @property
    def compiled(self) -> int:
        """Programs XLA compiled afresh."""
        return self.programs - self.cache_hits

    def __enter__(self) -> CompileCounter:
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
        jax.monitoring.unregister_event_listener(self._on_event)

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            self.programs += 1

    def _on_event(self, event: str, **kwargs) -> None:
        if event == _CACHE_HIT_EVENT:
            self.cache_hits += 1
