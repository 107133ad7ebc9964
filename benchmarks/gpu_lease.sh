# Sourced by the one-call lease scripts (gpu_check.sh, gpu_scale.sh): Python packages
# carried as wheels ($WHEELS), this checkout's src/ on the path, Multi30k linked where the
# tests look for it, and `step`. Expects OUT, LOG, PY and DATA (may be empty) to be set.
export PYTHONUNBUFFERED=1

if [ -n "${WHEELS:-}" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/aiayn-site "$WHEELS"/*.whl && export PYTHONPATH=/tmp/aiayn-site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# The tests read Multi30k from ../shared/data/multi30k (the checkout's neighbour, which
# does not travel to a lent machine): link the data given there.
SHARED="$(cd .. && pwd)/shared/data/multi30k"
if [ -n "$DATA" ] && [ ! -e "$SHARED" ]; then
    mkdir -p "$(dirname "$SHARED")" && ln -s "$(realpath "$DATA")" "$SHARED"
fi

step() {  # step NAME SECONDS COMMAND...: run with a limit, log its output and time
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date -u +%T), limit ${limit}s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout -k 20 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: rc $rc, $((SECONDS - t0)) s" | tee -a "$LOG"
}
