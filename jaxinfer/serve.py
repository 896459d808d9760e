"""The OpenAI-compatible server: `python -m jaxinfer.serve` (flags: --help).

Loads and warms up the engine, then serves /v1/completions, /v1/chat/completions, /v1/models,
/health and /version on --host:--port.
"""

from __future__ import annotations

import logging

import uvicorn
from absl import app, flags

from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.engine_flags import define_engine_flags, engine_options_from_flags
from jaxinfer.server.app import ServerConfig, build_app
from jaxinfer.server.async_engine import AsyncEngine

FLAGS = flags.FLAGS
define_engine_flags()
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
flags.DEFINE_integer("port", 8000, "Port to listen on.")
flags.DEFINE_string("served_model_name", None, "Model name clients use; default: the folder's.")


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    engine = LLMEngine(engine_options_from_flags())
    name = FLAGS.served_model_name or engine.config.model.path.name
    application = build_app(AsyncEngine(engine), ServerConfig(served_model_name=name))
    logging.info(
        "serving %s on http://%s:%d (warm-up %.1f s)",
        name,
        FLAGS.host,
        FLAGS.port,
        engine.warmup_seconds,
    )
    uvicorn.run(application, host=FLAGS.host, port=FLAGS.port, log_level="warning")


if __name__ == "__main__":
    app.run(main)
