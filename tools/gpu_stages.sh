# Stages under one time budget, for tools/gpu_smoke.sh and tools/gpu_check.sh (sourced, not run).
#
# The caller sets `out` (the output folder), `budget` (seconds for the whole script) and
# `backend` (the JAX backend once known), then runs `stage NAME LIMIT needs_gpu|any CMD...`.
# Each stage runs in its own process under `timeout`, with the smaller of its limit and what is
# left of the budget, writing its output to $out/NAME.txt; $out/summary.txt gets one line per
# stage: pass, FAIL, TIMEOUT or skipped (with why), the seconds taken and the limit.
# `finish` removes $out/cache, writes the verdict line and exits 1 if a stage failed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
python=python3
[ -x .venv/bin/python ] && python=.venv/bin/python
mkdir -p "$out"
summary="$out/summary.txt"
deadline=$((SECONDS + budget))
backend=${backend:-unknown}
failed=0
: > "$summary"

skip() {  # skip NAME WHY
    printf '%-15s skipped  (%s)\n' "$1" "$2" >> "$summary"
}

stage() {  # stage NAME LIMIT_SECONDS needs_gpu|any COMMAND...
    local name=$1 limit=$2 needs=$3
    shift 3
    if [ "$needs" = needs_gpu ] && [ "$backend" != gpu ]; then
        skip "$name" "no GPU: the JAX backend is $backend"
        return
    fi
    local left=$((deadline - SECONDS - 3))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -le 0 ]; then
        skip "$name" "the ${budget}s budget is spent"
        return
    fi
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" > "$out/$name.txt" 2>&1
    local rc=$? verdict=pass
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        verdict=TIMEOUT failed=1
    elif [ "$rc" -ne 0 ]; then
        verdict=FAIL failed=1
    fi
    printf '%-15s %-8s %4ds  (limit %ds, exit %d)\n' "$name" "$verdict" $((SECONDS - start)) \
        "$limit" "$rc" >> "$summary"
    echo "== $name: $verdict; tail of $out/$name.txt:"
    tail -n 15 "$out/$name.txt"
}

finish() {
    rm -rf "$out/cache"
    echo "$([ "$failed" -eq 0 ] && echo ok || echo FAILED) after ${SECONDS}s" >> "$summary"
    echo "== summary ($summary)"
    cat "$summary"
    exit "$failed"
}
