"""Batch runs: `python -m jaxinfer.run_batch --input=requests.jsonl --output=results.jsonl`.

The input is an OpenAI Batch file (one {"custom_id", "method", "url", "body"} per line, url
/v1/chat/completions or /v1/completions); each line's result is what the server would answer
for its body, in the Batch output format. Every line enters the engine at once. A bad line
gets an error record and the others still run; --resume continues an interrupted run; the
summary (`<output>.summary.json`) is written last. For quick runs, --prompts_file takes plain
prompts with sampling flags.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from absl import app, flags

from jaxinfer.batch.job import BatchIncompleteError, BatchJobConfig, check_paths, run_job
from jaxinfer.config.flags import (
    define_engine_flags,
    distributed_config_from_flags,
    engine_options_from_flags,
)
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.engine.lockstep import Leader, lead_or_follow
from jaxinfer.parallel.distributed import initialize
from jaxinfer.sampling_params import flag_fields
from jaxinfer.server.async_engine import AsyncEngine

FLAGS = flags.FLAGS
define_engine_flags()
flags.DEFINE_string("input", None, "OpenAI Batch input file (JSONL).")
flags.DEFINE_string("prompts_file", None, "Plain prompts, one per line, or .jsonl with `prompt`.")
flags.DEFINE_enum("prompt_format", "chat", ["chat", "completion"], "How --prompts_file is sent.")
flags.DEFINE_string("output", None, "Results file (OpenAI Batch output format).", required=True)
flags.DEFINE_string("summary_output", None, "Summary file; default: <output>.summary.json.")
flags.DEFINE_bool("resume", False, "Keep the results already in --output; answer the rest.")
flags.DEFINE_bool("overwrite", False, "Replace an existing --output.")
flags.DEFINE_string("served_model_name", None, "Model name bodies may give; default: folder's.")
flags.DEFINE_bool("progress", True, "Show a progress bar.")
# Sampling flags for --prompts_file (an --input line sets its own in its body), as
# SamplingParams declares them.
_DEFINE = {
    int: flags.DEFINE_integer,
    float: flags.DEFINE_float,
    bool: flags.DEFINE_bool,
    "multi_string": flags.DEFINE_multi_string,
}
for _name, (_kind, _help) in flag_fields().items():
    _DEFINE[_kind](_name, None, _help)


def job_config_from_flags(random_seed: int | None) -> BatchJobConfig:
    def path(value):
        return Path(value) if value is not None else None

    sampling = {name: FLAGS[name].value for name in flag_fields() if FLAGS[name].present}
    return BatchJobConfig(
        output=Path(FLAGS.output),
        input=path(FLAGS.input),
        prompts_file=path(FLAGS.prompts_file),
        prompt_format=FLAGS.prompt_format,
        sampling=sampling,
        summary=path(FLAGS.summary_output),
        resume=FLAGS.resume,
        overwrite=FLAGS.overwrite,
        show_progress=FLAGS.progress,
        random_seed=random_seed,
    )


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per in-process request
    try:
        distributed = distributed_config_from_flags()
        options = engine_options_from_flags()
        config = job_config_from_flags(options.random_seed)
        if not distributed.process_id:  # the files are process 0's alone
            check_paths(config)
    except (ValueError, OSError) as error:
        raise app.UsageError(str(error)) from None
    initialize(distributed, recoverable=True)
    # Under several processes, process 0 reads the input and writes the results; the others
    # follow its schedule (jaxinfer.engine.lockstep).
    engine = lead_or_follow(LLMEngine(options), distributed)
    if engine is None:
        return
    name = FLAGS.served_model_name or engine.config.model.path.name
    async_engine = AsyncEngine(engine)
    if isinstance(engine, Leader):
        engine.set_on_failure(async_engine.declare_dead)
    try:
        summary = run_job(config, async_engine, name)
    except ValueError as error:  # a results file that is not one
        raise app.UsageError(str(error)) from None
    except BatchIncompleteError as error:
        logging.error("%s", error)
        sys.exit(1)
    finally:
        if isinstance(engine, Leader):
            engine.close()
    print(summary.describe())
    print(f"results: {config.output}  summary: {config.summary_path}")


if __name__ == "__main__":
    app.run(main)
