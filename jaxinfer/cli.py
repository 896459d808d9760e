"""The `jaxinfer` command: `jaxinfer serve [MODEL] [flags]`, `jaxinfer run-batch [flags]`,
`jaxinfer bench [flags]`, `jaxinfer --version`.

Each subcommand is its `python -m` entry point (jaxinfer.serve, jaxinfer.run_batch,
tools.bench_throughput) with the same absl flags; `serve` also takes the model as its first
argument, as `vllm serve MODEL` does. Only the chosen entry point is imported: each defines
its flags when imported. `jaxinfer COMMAND --help` lists that command's flags in groups (its
own, the engine options, the several-process flags), each with its default.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import textwrap

COMMANDS = {
    "serve": ("jaxinfer.serve", "the OpenAI-compatible server"),
    "run-batch": (
        "jaxinfer.run_batch",
        "an OpenAI Batch file (or plain prompts) through the engine",
    ),
    "bench": ("tools.bench_throughput", "throughput and latency (a source checkout's tools/)"),
}

USAGE = (
    "usage: jaxinfer {serve,run-batch,bench} [MODEL] [--flags]   jaxinfer --version\n"
    + "".join(f"  {name:10} {text}\n" for name, (_, text) in COMMANDS.items())
    + "jaxinfer COMMAND --help lists the command's flags.\n"
)
# Flags of jaxinfer.config.flags that join processes rather than configure the engine.
PROCESS_FLAGS = ("coordinator_address", "num_processes", "process_id", "control_host")


def arguments(command: str, rest: list[str]) -> list[str]:
    """The entry point's argv (without the program name): `serve MODEL` becomes --model=MODEL."""
    if command == "serve" and rest and not rest[0].startswith("-"):
        return [f"--model={rest[0]}", *rest[1:]]
    return rest


def describe_flags(flag_list) -> str:
    lines = []
    for flag in sorted(flag_list, key=lambda f: f.name):
        text = flag.help or ""
        if flag.default is not None and "(default:" not in text:
            shown = (
                ",".join(map(str, flag.default)) if isinstance(flag.default, list) else flag.default
            )
            text += f" (default: {shown})"
        lines.append(f"  --{flag.name}")
        lines += textwrap.wrap(text, 96, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def flags_table(module_name: str) -> str:
    """A command's own flags as a Markdown table (flag, default, meaning): the README's table
    of the server's flags is this one, checked by a test."""
    from absl import flags

    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for flag in sorted(flags.FLAGS.get_flags_for_module(module_name), key=lambda f: f.name):
        default = flag.default
        if isinstance(default, list):
            default = ",".join(map(str, default))
        shown = "" if default in (None, "") else f"`{default}`"
        text = " ".join((flag.help or "").split()).replace("|", "\\|")  # one line a row
        rows.append(f"| `--{flag.name}` | {shown} | {text} |")
    return "\n".join(rows) + "\n"


def command_help(command: str, module) -> str:
    """A command's flags in groups: its own, the engine options, the several-process flags."""
    from absl import flags

    values = flags.FLAGS
    own = values.get_flags_for_module(module.__name__)
    common = values.get_flags_for_module("jaxinfer.config.flags")
    engine = [f for f in common if f.name not in PROCESS_FLAGS]
    processes = [f for f in common if f.name in PROCESS_FLAGS]
    usage = "jaxinfer serve [MODEL]" if command == "serve" else f"jaxinfer {command}"
    groups = [
        (f"{command} flags", own),
        ("Engine options (also [engine] keys of --config)", engine),
    ]
    groups.append(("Several processes (jax.distributed)", processes))
    text = f"usage: {usage} [--flags]\n{COMMANDS[command][1]}\n"
    for title, group in groups:
        if group:
            text += f"\n{title}:\n{describe_flags(group)}\n"
    return text + "\n--helpfull lists every flag, absl's own included.\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        sys.exit(0 if argv else 2)
    if argv[0] == "--version":
        sys.stdout.write(f"jaxinfer {importlib.metadata.version('jaxinfer')}\n")
        sys.exit(0)
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
    if "--help_markdown" in rest:  # the command's own flags as the README's table
        sys.stdout.write(flags_table(module.__name__))
        sys.exit(0)
    if any(a in ("-h", "--help", "-?") for a in rest):
        sys.stdout.write(command_help(command, module))
        sys.exit(0)
    from absl import app

    sys.argv = [sys.argv[0], *arguments(command, rest)]
    app.run(module.main)


if __name__ == "__main__":
    main()
