"""The `jaxinfer` command: `jaxinfer serve [MODEL] [flags]`, `jaxinfer run-batch [flags]`,
`jaxinfer bench [flags]`.

Each subcommand is its `python -m` entry point (jaxinfer.serve, jaxinfer.run_batch,
tools.bench_throughput) with the same absl flags; `serve` also takes the model as its first
argument, as `vllm serve MODEL` does. Only the chosen entry point is imported: each defines
its flags when imported.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "serve": ("jaxinfer.serve", "the OpenAI-compatible server"),
    "run-batch": (
        "jaxinfer.run_batch",
        "an OpenAI Batch file (or plain prompts) through the engine",
    ),
    "bench": ("tools.bench_throughput", "throughput and latency (a source checkout's tools/)"),
}

USAGE = (
    "usage: jaxinfer {serve,run-batch,bench} [MODEL] [--flags]  (--helpfull: every flag)\n"
    + "".join(f"  {name:10} {text}\n" for name, (_, text) in COMMANDS.items())
)


def arguments(command: str, rest: list[str]) -> list[str]:
    """The entry point's argv (without the program name): `serve MODEL` becomes --model=MODEL."""
    if command == "serve" and rest and not rest[0].startswith("-"):
        return [f"--model={rest[0]}", *rest[1:]]
    return rest


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        sys.exit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        sys.stderr.write(f"jaxinfer: unknown command {command!r}\n{USAGE}")
        sys.exit(2)
    module_name = COMMANDS[command][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if not module_name.startswith("tools."):
            raise
        sys.stderr.write(
            f"jaxinfer {command}: {module_name} is not installed ({error}); it runs from a "
            "source checkout of jaxinfer, with the test extra installed\n"
        )
        sys.exit(2)
    from absl import app, flags

    from jaxinfer.config import flags as engine_flags

    # --help lists the entry point's flags and the engine's
    flags.adopt_module_key_flags(module)
    flags.adopt_module_key_flags(engine_flags)
    sys.argv = [sys.argv[0], *arguments(command, rest)]
    app.run(module.main)


if __name__ == "__main__":
    main()
