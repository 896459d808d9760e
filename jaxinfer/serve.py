"""The OpenAI-compatible server: `python -m jaxinfer.serve` (flags: --help).

Loads and warms up the engine, then serves /v1/completions, /v1/chat/completions, /v1/models,
/tokenize, /detokenize, /metrics (Prometheus), /health and /version on --host:--port.
"""

from __future__ import annotations

import logging

import uvicorn
from absl import app, flags

from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.engine_flags import (
    define_engine_flags,
    distributed_config_from_flags,
    engine_options_from_flags,
)
from jaxinfer.parallel.distributed import initialize
from jaxinfer.server.app import ServerConfig, build_app
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.metrics import ServerMetrics

FLAGS = flags.FLAGS
define_engine_flags()
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
flags.DEFINE_integer("port", 8000, "Port to listen on.")
flags.DEFINE_string("served_model_name", None, "Model name clients use; default: the folder's.")
flags.DEFINE_string("api_key", None, "Require `Authorization: Bearer <key>` on the API.")
flags.DEFINE_integer("max_queued_requests", None, "Unfinished requests beyond which: 503.")
flags.DEFINE_integer("max_body_bytes", 4 << 20, "Larger request bodies: 413.")
flags.DEFINE_bool("allow_request_chat_template", False, "Accept chat_template in requests.")
flags.DEFINE_integer("shutdown_timeout", 30, "Seconds in-flight requests get on SIGTERM.")


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    distributed = distributed_config_from_flags()
    if distributed.enabled and distributed.num_processes > 1:
        raise app.UsageError(
            "the server runs on one host: every process of a multi-host engine must see every "
            "request, which the server does not broadcast yet; use jaxinfer.run_batch, whose "
            "processes all read the same input"
        )
    initialize(distributed)
    engine = LLMEngine(engine_options_from_flags())
    name = FLAGS.served_model_name or engine.config.model.path.name
    config = ServerConfig(
        served_model_name=name,
        api_key=FLAGS.api_key,
        max_queued_requests=FLAGS.max_queued_requests,
        max_body_bytes=FLAGS.max_body_bytes,
        allow_request_chat_template=FLAGS.allow_request_chat_template,
    )
    metrics = ServerMetrics(engine)
    application = build_app(AsyncEngine(engine, metrics.observe_finished), config, metrics)
    logging.info(
        "serving %s on http://%s:%d (warm-up %.1f s)",
        name,
        FLAGS.host,
        FLAGS.port,
        engine.warmup_seconds,
    )
    # uvicorn stops accepting on SIGTERM and waits for in-flight requests up to the timeout.
    uvicorn.run(
        application,
        host=FLAGS.host,
        port=FLAGS.port,
        log_level="warning",
        timeout_graceful_shutdown=FLAGS.shutdown_timeout,
    )


if __name__ == "__main__":
    app.run(main)
