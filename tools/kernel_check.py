"""Each Pallas kernel compiled and checked against its reference at model shapes and dtypes:
the first thing a new GPU is asked (tools/gpu_smoke.sh), with the engine's own start-up probe
(jaxinfer.layers.kernel_probe) run at each shape, so a pass here is what "auto" will see.

    python -m tools.kernel_check --shapes=smollm2,llama3_8b --dtypes=bfloat16,float32
    python -m tools.kernel_check --impl=pallas_interpret --shapes=smollm2   # on CPU

One row per (shape, dtype, kernel): pass or fail, the max abs error against the reference and
the error allowed, and the seconds it took (compile included). Exits 1 if any case failed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from absl import app, flags

from jaxinfer.layers.kernel_probe import REFERENCES, check_kernel
from jaxinfer.layers.kernel_registry import default_registry
from jaxinfer.models.shapes import shape

FLAGS = flags.FLAGS
flags.DEFINE_list("shapes", ["smollm2", "llama3_8b"], "Model shapes (jaxinfer.models.shapes).")
flags.DEFINE_list("dtypes", ["bfloat16", "float32"], "Activation and weight dtypes.")
flags.DEFINE_list("kinds", list(REFERENCES), "Kernel kinds.")
flags.DEFINE_enum("impl", "pallas", ["pallas", "pallas_interpret"], "Implementation checked.")
flags.DEFINE_integer("block_size", 16, "KV-cache block size.")
flags.DEFINE_string("output_json", None, "Also write the rows here.")


def run_checks(shapes, dtypes, kinds, impl: str, block_size: int) -> list[dict]:
    registry = default_registry()
    rows = []
    for shape_name in shapes:
        arch = shape(shape_name)
        for dtype in dtypes:
            for kind in kinds:
                start = time.perf_counter()
                result = check_kernel(kind, registry.get(kind, impl), arch, dtype, block_size)
                rows.append(
                    dict(
                        shape=shape_name,
                        dtype=dtype,
                        kind=kind,
                        impl=impl,
                        passed=result.reason is None,
                        error=result.error,
                        bound=result.bound,
                        reason=result.reason,
                        seconds=round(time.perf_counter() - start, 2),
                    )
                )
                print(_line(rows[-1]), flush=True)
    return rows


def _line(row: dict) -> str:
    status = "pass" if row["passed"] else "FAIL"
    error = "-" if row["error"] is None else f"{row['error']:.2e} (allowed {row['bound']:.1e})"
    why = f"  {row['reason']}" if row["reason"] else ""
    return (
        f"{status}  {row['shape']:<10} {row['dtype']:<9} {row['kind']:<10} {error:<28}"
        f" {row['seconds']:6.2f}s{why}"
    )


def main(argv):
    del argv
    rows = run_checks(FLAGS.shapes, FLAGS.dtypes, FLAGS.kinds, FLAGS.impl, FLAGS.block_size)
    if FLAGS.output_json:
        Path(FLAGS.output_json).write_text(json.dumps(rows, indent=1))
    failed = sum(not row["passed"] for row in rows)
    print(f"{len(rows) - failed} of {len(rows)} cases passed")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    app.run(main)
