"""Engine configuration: the options a user sets (options), the flags and TOML keys made from
them (flags), the platform and the one step that settles "auto" (platform, resolve), and the
frozen config the engine runs with (engine_config)."""

from jaxinfer.config.engine_config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    build_engine_config,
    model_arch,
    token_buckets,
)
from jaxinfer.config.options import EngineOptions

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "EngineOptions",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "build_engine_config",
    "model_arch",
    "token_buckets",
]
