"""Where a jitted call's device time goes: a profiler trace of a few calls, summed per kernel.

    rows = kernel_times(step, args, calls=3)
    print(format_kernel_times(rows, step_ms))

The trace is JAX's own (jax.profiler, read back through jax.profiler.ProfileData, so nothing
beyond jaxlib is needed). On a GPU the rows are the kernels the device ran (the "/device:GPU"
planes' stream lines: XLA fusions, cuBLAS calls, the Pallas kernels by name); on CPU, the
XLA:CPU thread pools' operations (a check of the tool, not a profile worth reading).
"""

from __future__ import annotations

import collections
import glob
import tempfile

import jax
from jax.profiler import ProfileData

# Lines of a device plane that repeat the stream's kernels in other groupings (counted once).
_SKIP_LINES = ("XLA Modules", "XLA Ops", "Steps", "Source", "TensorFlow Name Scope")


def kernel_times(fn, *args, calls: int = 3) -> list[dict]:
    """[{name, ms (per call), count (per call), share}], largest first, for `calls` calls of
    fn(*args) after one warm-up call."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        try:
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
        finally:
            jax.profiler.stop_trace()
        (path,) = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
        profile = ProfileData.from_file(path)
    on_device = [p for p in profile.planes if p.name.startswith("/device:")]
    planes = on_device or [p for p in profile.planes if p.name == "/host:CPU"]
    total_ns, count = collections.Counter(), collections.Counter()
    for plane in planes:
        for line in plane.lines:
            if line.name.startswith(_SKIP_LINES):
                continue
            for event in line.events:
                if event.duration_ns > 0 and not event.name.startswith("$"):  # "$": Python
                    total_ns[event.name] += event.duration_ns
                    count[event.name] += 1
    whole = sum(total_ns.values()) or 1
    return [
        dict(
            name=name,
            ms=ns / calls / 1e6,
            count=count[name] / calls,
            share=ns / whole,
        )
        for name, ns in total_ns.most_common()
    ]


def format_kernel_times(rows: list[dict], top: int = 25) -> str:
    """A table of the `top` rows, and the sum of all of them."""
    lines = [f"  {'ms/call':>9} {'calls':>6} {'share':>6}  kernel"]
    for row in rows[:top]:
        lines.append(
            f"  {row['ms']:9.3f} {row['count']:6.0f} {100 * row['share']:5.1f}%  {row['name'][:90]}"
        )
    rest = rows[top:]
    if rest:
        lines.append(
            f"  {sum(r['ms'] for r in rest):9.3f} {sum(r['count'] for r in rest):6.0f} "
            f"{100 * sum(r['share'] for r in rest):5.1f}%  ({len(rest)} other kernels)"
        )
    lines.append(f"  {sum(r['ms'] for r in rows):9.3f} ms of kernels per call in all")
    return "\n".join(lines)
