"""schemathesis over the server's /openapi.json: no input gets a 500 (a bounded run)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from jaxinfer.server.app import ServerConfig, build_app
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.background import serve
from tests.support.engines import build_engine

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def api_schema(tiny_model_dir):
    engine = build_engine(tiny_model_dir, "served")
    url, server = serve(build_app(AsyncEngine(engine), ServerConfig(served_model_name="tiny")))
    yield schemathesis.openapi.from_url(f"{url}/openapi.json")
    server.should_exit = True


def test_no_input_gets_a_500(api_schema):
    # schemathesis' own pytest plugin does not load under this pytest; its strategies do.
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 8
    for operation in operations:

        @settings(
            max_examples=8, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(case=operation.as_strategy())
        def check(case):
            response = case.call(timeout=60)
            assert response.status_code < 500, (case.path, case.body, response.text)

        check()
