#!/usr/bin/env bash
# One batched run on a GPU host: the gpu test suite, the benchmarks and the notebooks,
# with every log and JSON written under $OUT (default ./gpu-out; the device tool brings back 8 files).
# SKIP_TESTS, SKIP_NOTEBOOKS, SKIP_BENCH, SKIP_OVERLAP, SKIP_PREFETCH=1 leave a step out;
# GPU_TESTS names the test files (default: all of tests/), so the suite can be split over calls.
# FORMATS=1 adds, after the tests, bench_formats with its derived rows (issues 20, 21) under a time budget:
# FORMATS_BUDGET seconds (default 300; rows left are skipped and named), FORMATS_SIZE (4GiB per format),
# FORMATS_ONLY (raw,tiff,zarr-3d,zarr-zstd-3d: the issue-20 targets), FORMATS_DIR (/tmp/gpulazy-bench: the files
# are kept there and reused by the next call on the same warm machine), FORMATS_ARGS (more flags).
# OVERLAP_ARGS adds flags to bench_overlap, e.g. "--read-ahead 0,1GiB,4GiB" to sweep the read-ahead.
# On the offline GPU host begin with the install line of ../shared/tools/gpu-wheels.sh.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$OUT/env.txt"
import gpulazy, subprocess
subprocess.run(["python3", "-m", "gpulazy", "info"])
PY
[ -n "${SKIP_TESTS:-}" ] || timeout ${GPU_TEST_TIMEOUT:-240} python3 -m pytest -m "gpu and not slow" -q -p no:cacheprovider --durations=15 -o addopts="-ra --timeout=120" ${GPU_TESTS:-tests} 2>&1 | tee "$OUT/gpu-tests.log"
if [ -n "${FORMATS:-}" ]; then
  budget=${FORMATS_BUDGET:-300}
  # The budget stops new rows; the timeout (budget + 2 min for the row under way) is the backstop,
  # and the JSON, rewritten after every format, keeps what was measured.
  timeout $((budget + 120)) python3 benchmarks/bench_formats.py --derived --budget-s "$budget" \
    --size "${FORMATS_SIZE:-4GiB}" --only "${FORMATS_ONLY:-raw,tiff,zarr-3d,zarr-zstd-3d}" \
    --dir "${FORMATS_DIR:-/tmp/gpulazy-bench}" --json "$OUT/formats.json" ${FORMATS_ARGS:-} 2>&1 | tee "$OUT/formats.log"
fi
[ -n "${SKIP_NOTEBOOKS:-}" ] || timeout ${NB_TIMEOUT:-180} python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/test_notebooks.py 2>&1 | tee "$OUT/notebooks.log"
ls test-artifacts/*.ipynb >/dev/null 2>&1 && tar czf "$OUT/executed-notebooks.tgz" test-artifacts/*.ipynb
[ -n "${SKIP_BENCH:-}" ] || timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/run.py --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
[ -n "${SKIP_OVERLAP:-}" ] || timeout ${OVERLAP_TIMEOUT:-240} python3 benchmarks/bench_overlap.py --repeat 3 \
  --json "$OUT/overlap.json" ${OVERLAP_ARGS:-} 2>&1 | tee "$OUT/overlap.log"
if [ -z "${SKIP_PREFETCH:-}" ]; then
  for sched in sync threads; do
    timeout ${PREFETCH_TIMEOUT:-60} python3 benchmarks/bench_prefetch.py --scheduler $sched --repeat 2 \
      --json "$OUT/prefetch-$sched.json" 2>&1 | tee -a "$OUT/prefetch.log"
  done
fi
