#!/usr/bin/env bash
# One batched run on a GPU host: the gpu test suite, the benchmarks and the notebooks,
# with every log and JSON written under $OUT (default ./gpu-out; the device tool brings back 8 files).
# SKIP_TESTS, SKIP_NOTEBOOKS, SKIP_BENCH, SKIP_OVERLAP, SKIP_PREFETCH=1 leave a step out;
# GPU_TESTS names the test files (default: all of tests/), so the suite can be split over calls.
# On the offline GPU host begin with the install line of ../shared/tools/gpu-wheels.sh.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$OUT/env.txt"
import gpulazy, subprocess
subprocess.run(["python3", "-m", "gpulazy", "info"])
PY
[ -n "${SKIP_TESTS:-}" ] || timeout ${GPU_TEST_TIMEOUT:-240} python3 -m pytest -m "gpu and not slow" -q -p no:cacheprovider --durations=15 -o addopts="-ra --timeout=120" ${GPU_TESTS:-tests} 2>&1 | tee "$OUT/gpu-tests.log"
[ -n "${SKIP_NOTEBOOKS:-}" ] || timeout ${NB_TIMEOUT:-180} python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/test_notebooks.py 2>&1 | tee "$OUT/notebooks.log"
ls test-artifacts/*.ipynb >/dev/null 2>&1 && tar czf "$OUT/executed-notebooks.tgz" test-artifacts/*.ipynb
[ -n "${SKIP_BENCH:-}" ] || timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/run.py --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
[ -n "${SKIP_OVERLAP:-}" ] || timeout ${OVERLAP_TIMEOUT:-240} python3 benchmarks/bench_overlap.py --repeat 3 \
  --json "$OUT/overlap.json" 2>&1 | tee "$OUT/overlap.log"
if [ -z "${SKIP_PREFETCH:-}" ]; then
  for sched in sync threads; do
    timeout ${PREFETCH_TIMEOUT:-60} python3 benchmarks/bench_prefetch.py --scheduler $sched --repeat 2 \
      --json "$OUT/prefetch-$sched.json" 2>&1 | tee -a "$OUT/prefetch.log"
  done
fi
