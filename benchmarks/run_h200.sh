#!/usr/bin/env bash
# One device call on the H200: install the tree offline, run a stage, leave logs and results in $OUT.
#   bash benchmarks/run_h200.sh tests|compiled|suites|end_to_end [extra args for the benchmark]
# The machine has no network: the project installs with --no-deps; expecttest (not in the image)
# travels as a wheel in .whl/ (`pip download --no-deps -d .whl expecttest`, carried by the device tool).
# Earlier sessions' stages are in git history (benchmarks/run_h200.sh before 2026-12-01).
set -u -o pipefail
stage=${1:-tests}
shift || true
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
out=${OUT:-/tmp/out}
mkdir -p "$out"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$out/machine.txt"
case "$stage" in
  tests)  # every GPU-marked test in one run, then the kernel test files (they run on CUDA when present)
    timeout ${TESTS_TIMEOUT:-590} python3 -m pytest -q -p no:cacheprovider -rxs --continue-on-collection-errors -m gpu tests "$@" 2>&1 \
      | tee "$out/gpu-tests.log" | tail -25
    ;;
  kernels)
    timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -rs tests/test_qk_norm_rope_cache_kernel.py \
      tests/test_qkv_rope_qk_norm_backward_kernel.py tests/test_kernels_in_graph.py "$@" 2>&1 \
      | tee "$out/gpu-kernel-tests.log" | tail -15
    ;;
  compiled)  # suites F and B as compiled code runs them, stock vs the pass, default mode and CUDA graphs
    python3 benchmarks/bench_compiled.py --out "$out" "$@" 2>&1 | tee "$out/compiled.log" | grep -v "^|" | tail -40
    ;;
  suites)
    python3 benchmarks/bench_forward.py --out "$out" --no-sweep "$@" 2>&1 | tee "$out/forward.log" | tail -20
    ;;
  end_to_end)
    python3 benchmarks/bench_end_to_end.py --out "$out" "$@" 2>&1 | tee "$out/end-to-end.log" | tail -40
    ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
