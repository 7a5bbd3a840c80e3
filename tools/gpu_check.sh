#!/usr/bin/env bash
# The GPU checks in one time-boxed run, for a GPU machine without network (one H100/H200, 16
# cores, Python 3.12 with torch, transformers, peft, tokenizers, safetensors, tensorboard, pytest,
# pytest-timeout, pytest-xdist; no megatron-core, omegaconf or TransformerEngine).
#
#   bash tools/gpu_check.sh [LOG_DIR]          # on the GPU machine, from the repository root
#   bash tools/gpu_check.sh --cpu-smoke [LOG_DIR]   # the same steps at tiny size on a CPU
#
# What the machine lacks travels as wheels in .whl/ (git-ignored). Download them beforehand on a
# machine with network, from the repository root:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     -d .whl megatron-core==0.16.1 omegaconf==2.4.0
#
# (for --cpu-smoke on another Python, the same with that --python-version: pip takes the wheel
# that fits the interpreter). Steps, each under `timeout`, in this order, with what is left of a
# deadline of 470 s (DEADLINE_S) so that the whole run fits 8 minutes:
#   1. install the wheels into a temporary directory, put it and the repository on PYTHONPATH
#      (wheels in .whl/optional/ too, kept only if OPTIONAL_IMPORTS, default "datasets", import);
#   2. the README main job: mbridge pretrain --recipe tiny_gpt_pretrain_config;
#   3. tools/bench_gpu.py (BENCH_VARIANTS, BENCH_ITERS): SDPA, the hand-written loop, fused SwiGLU and
#      cross-entropy, unfused attention, LoRA, each with measured and planned memory;
#   4. tools/profile_step.py (PROFILE=0 leaves it out): the step's time by part of the model;
#   5. the GPU test lane: pytest -m gpu -q -rs -p no:cacheprovider tests/ (skips listed with reasons);
#   6. with RETEST set (test ids), those tests alone, with full tracebacks;
#   7. the whole suite with pytest-xdist, if at least SUITE_MIN_S seconds are left.
# STEPS chooses steps 2-7 and their order, by name (default: "readme_job bench profile gpu_tests
# retest suite"), e.g. STEPS="suite bench" to give the suite the time first; the suite then leaves
# SUITE_RESERVE_S seconds of the deadline to the steps after it. SUITE_WORKERS: xdist workers (12);
# SUITE_ARGS: what pytest runs (default: all of tests/). Failures' tracebacks go to failures.log as
# they happen. ENVIRONMENT=0 leaves out the version check and nvidia-smi (22 s).
# The suite runs with `--dist worksteal` (idle workers take tests queued on busy ones). It took
# about 12 minutes on 16 cores (1,337 tests on an H100), before the module fixtures that start all
# their cases at once learned to start each case on demand under xdist (tests/factories.started):
# every worker that ran one of their tests had started them all. Where one command may run for
# less than the suite needs, start the check detached
# from a copy of the repository and read its log directory from a later command:
#   cp -a . /tmp/r && cd /tmp/r && STEPS=suite DEADLINE_S=740 SUITE_MIN_S=60 SUITE_WORKERS=16 \
#     setsid nohup bash tools/gpu_check.sh /tmp/gc > /dev/null 2>&1 < /dev/null &
# then wait until /tmp/gc/summary.txt has its `total:` line.
# Each step writes its log into LOG_DIR (default: $OUT when set, else ./gpu_check_logs) as it runs,
# and appends its outcome to LOG_DIR/summary.txt, so a run cut short still returns what it got.
# Exit status: 0 if every step that ran passed, 1 otherwise, 2 if the wheels are missing or the
# arguments are not these.
set -u

SMOKE=0
if [ "${1:-}" = "--cpu-smoke" ]; then
    SMOKE=1
    shift
fi
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 0
fi
if [ $# -gt 1 ] || case "${1:-}" in -*) true ;; *) false ;; esac; then
    echo "gpu_check.sh: unexpected arguments: $*" >&2
    echo "usage: bash tools/gpu_check.sh [--cpu-smoke] [LOG_DIR]   (--help describes the steps)" >&2
    exit 2
fi
STEPS="${STEPS:-readme_job bench profile gpu_tests retest suite}"
[ "${PROFILE:-1}" = 0 ] && STEPS="${STEPS//profile/}"
for name in $STEPS; do
    case "$name" in
        readme_job | bench | profile | gpu_tests | retest | suite) ;;
        *)
            echo "gpu_check.sh: unknown step in STEPS: $name (the steps: readme_job bench profile gpu_tests retest suite)" >&2
            exit 2
            ;;
    esac
done
LOG_DIR="${1:-${OUT:-./gpu_check_logs}}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
WHL_DIR="${WHL_DIR:-$REPO/.whl}"
PYTHON="${PYTHON:-python3}"
DEADLINE_S="${DEADLINE_S:-470}"
SUITE_MIN_S="${SUITE_MIN_S:-200}"
if [ "$SMOKE" = 1 ]; then
    BENCH_VARIANTS="${BENCH_VARIANTS:-pretrain,unfused}"
    BENCH_ARGS="--tiny --rounds 1 --iters 2 --warmup 1"
    PROFILE_ARGS="--tiny --steps 1 --warmup 1"
    JOB_ARGS="train.train_iters=5 validation.eval_iters=1"
    SUITE_WORKERS=2
    SUITE_ARGS="tests/test_bench_gpu.py -k refused"  # the xdist path, on two cheap tests
else
    BENCH_VARIANTS="${BENCH_VARIANTS:-pretrain,handwritten,fused,unfused,lora}"
    BENCH_ARGS="--rounds 1 --iters ${BENCH_ITERS:-10} --warmup 4"
    PROFILE_ARGS="--steps 2 --warmup 2"
    JOB_ARGS=""
    SUITE_WORKERS="${SUITE_WORKERS:-12}"
    SUITE_ARGS="${SUITE_ARGS:-}"
fi

mkdir -p "$LOG_DIR" || exit 2
LOG_DIR="$(cd "$LOG_DIR" && pwd)"
SUMMARY="$LOG_DIR/summary.txt"
START=$(date +%s)
FAILED=0
echo "gpu_check $(date -u +%FT%TZ) smoke=$SMOKE repo=$REPO commit=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')" > "$SUMMARY"

left() { echo $(( DEADLINE_S - ($(date +%s) - START) )); }

# step NAME CAP_SECONDS COMMAND...: run COMMAND in the repository with its output in
# LOG_DIR/NAME.log, for at most CAP_SECONDS or what is left of the deadline.
step() {
    local name="$1" cap="$2"
    shift 2
    local budget
    budget=$(left)
    [ "$cap" -lt "$budget" ] && budget="$cap"
    if [ "$budget" -lt 10 ]; then
        echo "$name: skipped ($(left) s left of ${DEADLINE_S} s)" | tee -a "$SUMMARY"
        return 0
    fi
    local t0 rc verdict
    t0=$(date +%s)
    (cd "$REPO" && timeout -k 10 "$budget" "$@") > "$LOG_DIR/$name.log" 2>&1
    rc=$?
    case $rc in
        0) verdict="ok" ;;
        124 | 137) verdict="TIMED OUT after ${budget} s"; FAILED=1 ;;
        5) verdict="FAILED (exit 5: pytest collected no tests)"; FAILED=1 ;;
        *) verdict="FAILED (exit $rc)"; FAILED=1 ;;
    esac
    echo "$name: $verdict in $(( $(date +%s) - t0 )) s (log: $name.log)" | tee -a "$SUMMARY"
    return $rc
}

# 1. the carried wheels
shopt -s nullglob
wheels=("$WHL_DIR"/megatron_core-*.whl)
if [ ${#wheels[@]} -eq 0 ] || [ -z "$(ls "$WHL_DIR"/omegaconf-*.whl 2>/dev/null)" ]; then
    {
        echo "install: no megatron-core and omegaconf wheels in $WHL_DIR"
        echo "  download them on a machine with network, from the repository root (see this script's header):"
        echo "  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\"
        echo "    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \\"
        echo "    -d .whl megatron-core==0.16.1 omegaconf==2.4.0"
    } | tee -a "$SUMMARY" >&2
    exit 2
fi
SITE="$(mktemp -d)"
JOB_DIR="$(mktemp -d)"
trap 'rm -rf "$SITE" "$JOB_DIR"' EXIT
step install 120 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    --find-links "$WHL_DIR" megatron-core omegaconf || {
    echo "install failed: see $LOG_DIR/install.log" | tee -a "$SUMMARY" >&2
    exit 2
}
export PYTHONPATH="$SITE:$REPO" PYTHONUNBUFFERED=1
# Optional packages the machine lacks (datasets, say) travel in .whl/optional/; they stay on the
# path only if OPTIONAL_IMPORTS import with them, so a wheel that does not fit the machine's own
# packages makes tests skip, as without it, rather than fail.
if ls "$WHL_DIR"/optional/*.whl > /dev/null 2>&1; then
    mkdir -p "$SITE/optional"
    failed_before=$FAILED  # an optional wheel that does not fit fails no step of the check
    if step optional_install 120 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SITE/optional" "$WHL_DIR"/optional/*.whl &&
        PYTHONPATH="$PYTHONPATH:$SITE/optional" step optional_imports 60 "$PYTHON" -c "
import importlib
for name in '${OPTIONAL_IMPORTS:-datasets}'.split():
    print(name, getattr(importlib.import_module(name), '__version__', '?'))
"; then
        export PYTHONPATH="$PYTHONPATH:$SITE/optional"
    else
        echo "optional wheels left out: see optional_install.log and optional_imports.log" | tee -a "$SUMMARY"
        FAILED=$failed_before
    fi
fi
[ "${ENVIRONMENT:-1}" = 0 ] || step environment 60 "$PYTHON" -c "
import torch, megatron.core, omegaconf, sys
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')
print('megatron-core', megatron.core.__version__, 'from', megatron.core.__file__)
"
[ "${ENVIRONMENT:-1}" = 0 ] || ! command -v nvidia-smi > /dev/null || nvidia-smi > "$LOG_DIR/nvidia-smi.log" 2>&1

# The steps, as functions; STEPS chooses which run and in what order.
readme_job() {
    # shellcheck disable=SC2086
    step readme_job 120 "$PYTHON" -m megatron_bridge pretrain --recipe tiny_gpt_pretrain_config --dir "$JOB_DIR" $JOB_ARGS
}

bench() {
    # its lines land in the log as each variant ends
    # shellcheck disable=SC2086
    step bench 300 "$PYTHON" tools/bench_gpu.py --variants "$BENCH_VARIANTS" $BENCH_ARGS
    grep -E "^(device|[a-z+]+ +(median|FAILED)|ratio|trackers|unfused/|LoRA/)" "$LOG_DIR/bench.log" 2>/dev/null |
        sed 's/^/  /' | tee -a "$SUMMARY"
}

profile() {
    # shellcheck disable=SC2086
    step profile 150 "$PYTHON" tools/profile_step.py $PROFILE_ARGS
    grep -E "^(device|[0-9]+ steps profiled)| ms/step " "$LOG_DIR/profile.log" 2>/dev/null | sed 's/^/  /' |
        tee -a "$SUMMARY"
}

gpu_tests() {
    step gpu_tests 150 "$PYTHON" -m pytest -m gpu -q -rs -p no:cacheprovider tests/
    tail -n 3 "$LOG_DIR/gpu_tests.log" 2>/dev/null | sed 's/^/  /' | tee -a "$SUMMARY"
}

retest() {
    # chosen tests with full tracebacks (RETEST="tests/a.py::test_x tests/b.py")
    [ -n "${RETEST:-}" ] || return 0
    local -
    set -f  # test ids hold brackets: words, not patterns
    # shellcheck disable=SC2086
    TEST_FAILURE_LOG="$LOG_DIR/failures.log" step retest 240 "$PYTHON" -m pytest -q --tb=long -rfEs -p no:cacheprovider $RETEST
    tail -n 1 "$LOG_DIR/retest.log" 2>/dev/null | sed 's/^/  /' | tee -a "$SUMMARY"
}

suite() {
    local args="$SUITE_ARGS"
    local -
    set -f  # test ids hold brackets: words, not patterns
    if "$PYTHON" -c "import xdist" 2> /dev/null; then
        args="-n $SUITE_WORKERS --dist worksteal $args"
    else
        echo "suite: pytest-xdist is not installed, the suite runs in one process" | tee -a "$SUMMARY"
    fi
    if [ "$(left)" -lt "$SUITE_MIN_S" ]; then
        echo "suite: skipped ($(left) s left, it needs ${SUITE_MIN_S} s)" | tee -a "$SUMMARY"
        return 0
    fi
    # -v names each failure as it happens, so a run cut short still says which tests failed;
    # -rfEs lists failures, errors and skips (with their reasons) at the end; --tb=short keeps
    # every traceback in the log without drowning it
    # shellcheck disable=SC2086
    # one thread per process: SUITE_WORKERS workers each starting torch with every core's worth of
    # threads (and their training subprocesses too) would oversubscribe the machine many times over
    OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TEST_FAILURE_LOG="$LOG_DIR/failures.log" step suite "$(( $(left) - ${SUITE_RESERVE_S:-0} ))" "$PYTHON" -m pytest -v --tb=short -rfEs -p no:cacheprovider $args
    grep -E "(FAILED|ERROR) tests/" "$LOG_DIR/suite.log" 2>/dev/null |
        sed -E 's/^.*(FAILED|ERROR) (tests\/[^ ]+).*$/  \1 \2/' | sort -u | tee -a "$SUMMARY"
    tail -n 1 "$LOG_DIR/suite.log" 2>/dev/null | sed 's/^/  /' | tee -a "$SUMMARY"
}

for name in $STEPS; do
    "$name"
done

echo "total: $(( $(date +%s) - START )) s; $([ $FAILED = 0 ] && echo 'every step that ran passed' || echo 'some steps failed')" | tee -a "$SUMMARY"
exit $FAILED
