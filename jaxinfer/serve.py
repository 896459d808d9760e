"""The OpenAI-compatible server: `python -m jaxinfer.serve` (flags: --help).

Loads and warms up the engine, then serves /v1/completions, /v1/chat/completions, /v1/models,
/tokenize, /detokenize, /metrics (Prometheus), /health, /version and /v1/engine (the resolved
options) on --host:--port.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import uvicorn
from absl import app, flags

from jaxinfer.config.flags import (
    define_engine_flags,
    distributed_config_from_flags,
    engine_options_from_flags,
)
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.engine.lockstep import Leader, lead_or_follow
from jaxinfer.parallel.distributed import initialize
from jaxinfer.server.app import ServerConfig, build_app
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.guard import HostPolicy, check_api_key
from jaxinfer.server.metrics import ServerMetrics

FLAGS = flags.FLAGS
define_engine_flags()
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
flags.DEFINE_integer("port", 8000, "Port to listen on.")
flags.DEFINE_string("served_model_name", None, "Model name clients use; default: the folder's.")
flags.DEFINE_string(
    "api_key", None, "Require `Authorization: Bearer <key>` (visible in `ps`: prefer the file)."
)
flags.DEFINE_string("api_key_file", None, "File holding the API key (its first line).")
flags.DEFINE_integer(
    "max_queued_requests", 1024, "Sequences (prompts x n) held at once; beyond: 503. 0: no limit."
)
flags.DEFINE_integer("max_body_bytes", 4 << 20, "Larger request bodies: 413.")
flags.DEFINE_bool("allow_request_chat_template", False, "Accept chat_template in requests.")
flags.DEFINE_float("chat_template_timeout", 5.0, "Seconds a request's own chat template gets.")
flags.DEFINE_list(
    "allowed_hosts",
    None,
    "Host names the server answers besides the loopback ones and --host ('*': any); bound to "
    "all interfaces it also answers any IP address.",
)
flags.DEFINE_float("engine_step_timeout", 60.0, "A step running longer: /health 503, engine dead.")
flags.DEFINE_float("grammar_timeout", 10.0, "Seconds a structured-output spec may compile.")
flags.DEFINE_bool(
    "exit_on_engine_failure", False, "Exit with status 1 when the engine dies or stalls."
)
flags.DEFINE_integer("shutdown_timeout", 30, "Seconds in-flight requests get on SIGTERM.")
flags.DEFINE_bool(
    "enable_docs", False, "Serve Swagger UI at /docs (its scripts come from a CDN; behind the key)."
)
flags.DEFINE_multi_string(
    "lora_modules",
    [],
    "A LoRA adapter served as model NAME: NAME=PEFT_FOLDER (with enable_lora)",
)
flags.DEFINE_bool(
    "enable_lora_runtime_updates",
    False,
    "Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key).",
)


def _api_key() -> str | None:
    if FLAGS.api_key is not None and FLAGS.api_key_file is not None:
        raise app.UsageError("give --api_key or --api_key_file, not both")
    if FLAGS.api_key_file is None:
        key = FLAGS.api_key
    else:
        lines = Path(FLAGS.api_key_file).read_text().splitlines()
        if not lines or not lines[0].strip():
            raise app.UsageError(f"{FLAGS.api_key_file} holds no API key")
        key = lines[0].strip()
    try:
        check_api_key(key)
    except ValueError as error:
        raise app.UsageError(str(error)) from None
    return key


def _lora_modules() -> tuple[tuple[str, str], ...]:
    modules = []
    for entry in FLAGS.lora_modules:
        name, _, path = entry.partition("=")
        if not name or not path:
            raise app.UsageError(f"--lora_modules takes NAME=PEFT_FOLDER, got {entry!r}")
        modules.append((name, path))
    if len({name for name, _ in modules}) != len(modules):
        raise app.UsageError("--lora_modules names two adapters alike")
    return tuple(modules)


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    distributed = distributed_config_from_flags()
    api_key = _api_key()
    lora_modules = _lora_modules()
    initialize(distributed, recoverable=True)
    # The server compiles its rarer token buckets while it serves, where it can.
    options = engine_options_from_flags(defaults={"warmup": "auto"})
    engine = lead_or_follow(LLMEngine(options), distributed)
    if engine is None:  # a process > 0: it followed process 0 until the job stopped
        return
    name = FLAGS.served_model_name or engine.config.model.path.name
    config = ServerConfig(
        served_model_name=name,
        api_key=api_key,
        max_queued_requests=FLAGS.max_queued_requests or None,
        max_body_bytes=FLAGS.max_body_bytes,
        allow_request_chat_template=FLAGS.allow_request_chat_template,
        chat_template_timeout=FLAGS.chat_template_timeout,
        host_policy=HostPolicy.for_server(FLAGS.host, FLAGS.allowed_hosts),
        engine_step_timeout=FLAGS.engine_step_timeout,
        enable_docs=FLAGS.enable_docs,
        lora_modules=lora_modules,
        enable_lora_runtime_updates=FLAGS.enable_lora_runtime_updates,
    )
    metrics = ServerMetrics(engine)
    async_engine = AsyncEngine(
        engine, metrics.observe_finished, grammar_timeout=FLAGS.grammar_timeout
    )
    engine_failed = False
    if isinstance(engine, Leader):  # a process of the job that fails ends the engine
        engine.set_on_failure(async_engine.declare_dead)

    def on_engine_dead() -> None:
        nonlocal engine_failed
        if FLAGS.exit_on_engine_failure:
            logging.error("the engine has failed: shutting down (--exit_on_engine_failure)")
            engine_failed = True
            server.should_exit = True

    # Under several processes, shutting down stops the others too (before uvicorn re-raises
    # the signal that stopped it).
    on_shutdown = engine.close if isinstance(engine, Leader) else None
    application = build_app(async_engine, config, metrics, on_engine_dead, on_shutdown)
    # uvicorn stops accepting on SIGTERM and waits for in-flight requests up to the timeout.
    server = uvicorn.Server(
        uvicorn.Config(
            application,
            host=FLAGS.host,
            port=FLAGS.port,
            log_level="warning",
            timeout_graceful_shutdown=FLAGS.shutdown_timeout,
        )
    )
    logging.info(
        "serving %s on http://%s:%d (warm-up %.1f s)",
        name,
        FLAGS.host,
        FLAGS.port,
        engine.warmup_seconds,
    )
    server.run()
    if engine_failed:
        # The engine thread may still be inside a stalled step: do not wait for it.
        logging.shutdown()
        os._exit(1)


if __name__ == "__main__":
    app.run(main)
