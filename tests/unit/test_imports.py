"""The package's shape: no module imports one that imports it back (type-only imports count),
no package reaches up to one built on it (the layers below), and no file outgrows one job."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "jaxinfer"

# Lowest first: a module may import its own part or any part listed before it.
LAYERS = (
    (
        "jaxinfer.outputs",
        "jaxinfer.sampling_params",
        "jaxinfer.arch_config",
        "jaxinfer.lora_request",
    ),
    ("jaxinfer.pooling_params",),
    ("jaxinfer.models.families",),  # read by the engine's config: below it
    ("jaxinfer.chat_template", "jaxinfer.tokenizer"),
    ("jaxinfer.parallel",),
    ("jaxinfer.layers",),
    ("jaxinfer.config", "jaxinfer.reasoning"),
    ("jaxinfer.models",),
    ("jaxinfer.model_loader",),
    ("jaxinfer.engine",),
    ("jaxinfer.server",),
    ("jaxinfer.batch",),
    ("jaxinfer.llm",),
    ("jaxinfer", "jaxinfer.serve", "jaxinfer.run_batch", "jaxinfer.demo", "jaxinfer.cli"),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the jaxinfer modules it imports (anywhere in it, under TYPE_CHECKING too)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith("jaxinfer")}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxinfer"):
                for alias in node.names:  # `from jaxinfer.x import y` may name a module
                    submodule = f"{node.module}.{alias.name}"
                    targets.add(submodule if submodule in modules else node.module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def layer_of(module: str) -> int:
    best, index = None, None
    for i, group in enumerate(LAYERS):
        for prefix in group:
            inside = module == prefix or (module.startswith(prefix + ".") and prefix != "jaxinfer")
            if inside and (best is None or len(prefix) > len(best)):
                best, index = prefix, i
    assert index is not None, f"{module} is in no layer of LAYERS"
    return index


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each circle found by a depth-first walk, as the modules along it."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    found = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                found.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def climbs(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{source} -> {target}"
        for source, targets in graph.items()
        for target in targets
        if layer_of(target) > layer_of(source)
    )


def test_no_module_imports_one_that_imports_it_back():
    found = cycles(import_graph())
    assert not found, "\n".join(" -> ".join(cycle) for cycle in found)


def test_no_import_reaches_up_a_layer():
    found = climbs(import_graph())
    assert not found, "\n".join(found)


def test_the_checks_see_a_climb_and_a_circle():
    """On made-up graphs: what the tests above look for is seen."""
    graph = {
        "jaxinfer.engine.a": {"jaxinfer.engine.b"},
        "jaxinfer.engine.b": {"jaxinfer.engine.c"},
        "jaxinfer.engine.c": {"jaxinfer.engine.a"},
        "jaxinfer.layers.rotary": {"jaxinfer.models.llama"},
        "jaxinfer.models.llama": {"jaxinfer.layers.rotary"},
    }
    assert ["jaxinfer.engine.a", "jaxinfer.engine.b", "jaxinfer.engine.c", "jaxinfer.engine.a"] in (
        cycles(graph)
    )
    assert climbs(graph) == ["jaxinfer.layers.rotary -> jaxinfer.models.llama"]
    # and the real graph is read: the scheduler's import of the step's types is in it
    assert (
        "jaxinfer.engine.execution.step" in import_graph()["jaxinfer.engine.scheduling.scheduler"]
    )


def test_every_file_has_one_job_and_at_most_400_lines():
    """A file past 400 lines holds more than one concern: split it by concern."""
    long = {
        str(path.relative_to(PACKAGE.parent)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 400
    }
    assert not long, long
