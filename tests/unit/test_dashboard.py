"""examples/grafana/jaxinfer.json queries only metrics the server exports."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from jaxinfer.config.cache_specs import AttentionSpec
from jaxinfer.config.engine_config import CacheConfig
from jaxinfer.engine.scheduling.stats import SchedulerStats, SpecStats
from jaxinfer.layers.kv_cache import KVCacheFormat
from jaxinfer.server.metrics import ServerMetrics

DASHBOARD = Path(__file__).parents[2] / "examples" / "grafana" / "jaxinfer.json"


def exported_samples() -> set[str]:
    """The sample names of /metrics for an engine with speculative decoding (every metric)."""
    spec = SpecStats()
    spec.record(3, 2)  # proposals and acceptances, so the per-position counter has samples
    fields = {name: 0 for name in SchedulerStats.__dataclass_fields__}
    kinds = {"kv_blocks": 8, "recurrent_states": 4}
    fields.update(cache_usage=dict.fromkeys(kinds, 0.0), cache_capacity=kinds)
    stats = SchedulerStats(**{**fields, "kv_cache_usage": 0.0, "spec": spec.snapshot()})
    engine = types.SimpleNamespace(
        config=types.SimpleNamespace(
            speculative=types.SimpleNamespace(method="ngram"),
            cache=CacheConfig(
                block_size=16,
                num_blocks=9,
                kv_format=KVCacheFormat.resolve("auto", "float32"),
                layer_specs=(AttentionSpec((0,)),),
            ),
        ),
        stats=lambda: stats,
        background_compile=None,
    )
    text = ServerMetrics(engine).render().decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_queried_metric_is_exported():
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"jaxinfer:[a-z0-9_]+", target["expr"])
    }
    assert len(queried) >= 12
    missing = queried - exported_samples()
    assert not missing, f"the dashboard queries metrics the server does not export: {missing}"
