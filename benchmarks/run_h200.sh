#!/usr/bin/env bash
# One device call on the H200: install the tree, run a stage, leave logs and results in $OUT.
#   bash benchmarks/run_h200.sh diag|tests|forward|backward|final|quick|all
# The machine has no network: the project installs offline, expecttest travels as a wheel
# in .whl/ (carried by the device tool).
set -u
stage=${1:-all}
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

run_tests() {
  timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider -rs -s \
    tests/test_qk_norm_rope_cache_kernel.py tests/test_qkv_rope_qk_norm_backward_kernel.py \
    tests/test_qk_norm_rope_cache_model.py tests/test_qk_norm_rope_cache_op.py 2>&1 | tee "$out/gpu-tests.log" | tail -30
}
run_tests_all() {
  # Every kernel test (they run on CUDA when present), then the GPU-marked whole-model tests.
  timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -rs \
    tests/test_qk_norm_rope_cache_kernel.py tests/test_qkv_rope_qk_norm_backward_kernel.py \
    2>&1 | tee "$out/gpu-tests.log" | tail -6
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rs -m gpu \
    tests/test_qk_norm_rope_cache_model.py tests/test_qkv_rope_qk_norm_numerics.py \
    2>&1 | tee "$out/gpu-model-tests.log" | tail -12
}
run_tests_kernels() {
  timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -rs \
    tests/test_qk_norm_rope_cache_kernel.py tests/test_qkv_rope_qk_norm_backward_kernel.py 2>&1 | tee "$out/gpu-tests.log" | tail -15
}
case "$stage" in
  gpu-b) TESTS_TIMEOUT=300 run_tests_all
       timeout 280 python3 benchmarks/bench_backward.py --out "$out" --compile-budget-s 70 2>&1 | tee "$out/backward.log" | tail -25 ;;
  gpu-f) TESTS_TIMEOUT=170 run_tests_kernels
       timeout 290 python3 benchmarks/bench_forward.py --out "$out" --no-sweep 2>&1 | tee "$out/forward.log" | tail -20
       timeout 110 python3 benchmarks/diagnose_device_time.py --out "$out" 2>&1 | tee "$out/diagnose.log" ;;
  suites) # Kernel GPU tests, then both suites; stock compile columns from run 2 (same versions).
       TESTS_TIMEOUT=150 run_tests_kernels
       timeout 200 python3 benchmarks/bench_forward.py --out "$out" --no-sweep \
         --stock-from benchmarks/results/2026-11-29-h200-forward-run2.json 2>&1 | tee "$out/forward.log" | tail -6
       timeout 150 python3 benchmarks/bench_backward.py --out "$out" \
         --stock-from benchmarks/results/2026-11-29-h200-backward-run2.json 2>&1 | tee "$out/backward.log" | tail -22 ;;
  e2e) timeout 130 python3 -m pytest -q -p no:cacheprovider -rs -m gpu \
         tests/test_qk_norm_rope_cache_model.py tests/test_qkv_rope_qk_norm_numerics.py 2>&1 | tee "$out/gpu-model-tests.log" | tail -8
       timeout 370 python3 benchmarks/bench_end_to_end.py --out "$out" --quick --cases \
         hunyuan_train_B2_S2048,qwen3_prefill_B1_S2048,qwen3_decode_B8_ctx256,qwen3_prefill_B8_S256,qwen3_decode_B1_ctx2048 \
         2>&1 | tee "$out/end-to-end.log" | tail -40 ;;
  e2e-train) timeout 560 python3 benchmarks/bench_end_to_end.py --out "$out" --quick --cases hunyuan_train_B2_S2048 2>&1 \
         | tee "$out/end-to-end-train.log" | tail -30 ;;
  bwd-diag) timeout 100 python3 -m pytest -q -p no:cacheprovider -rs tests/test_qkv_rope_qk_norm_backward_kernel.py \
         2>&1 | tee "$out/gpu-tests.log" | tail -4
       timeout 100 python3 benchmarks/diagnose_device_time.py --out "$out" --sections backward 2>&1 | tee "$out/diagnose.log" ;;
  diag) TESTS_TIMEOUT=300 run_tests_kernels
       timeout 240 python3 benchmarks/diagnose_device_time.py --out "$out" 2>&1 | tee "$out/diagnose.log" ;;
  tests) run_tests ;;
  forward) timeout 540 python3 benchmarks/bench_forward.py --out "$out" 2>&1 | tee "$out/forward.log" | tail -40 ;;
  backward) timeout 540 python3 benchmarks/bench_backward.py --out "$out" 2>&1 | tee "$out/backward.log" | tail -40 ;;
  backward+tests) timeout 400 python3 benchmarks/bench_backward.py --out "$out" 2>&1 | tee "$out/backward.log" | tail -30
       run_tests ;;
  forward+tests) timeout 330 python3 benchmarks/bench_forward.py --out "$out" 2>&1 | tee "$out/forward.log" | tail -30
       timeout 60 python3 benchmarks/diagnose_forward_rounding.py 2>&1 | tee "$out/rounding.log"
       timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -rs -s \
         tests/test_qk_norm_rope_cache_kernel.py tests/test_qk_norm_rope_cache_model.py 2>&1 | tee "$out/gpu-tests.log" | tail -25 ;;
  final) timeout 190 python3 benchmarks/bench_forward.py --out "$out" --no-sweep 2>&1 | tee "$out/forward.log" | tail -8
       timeout 200 python3 benchmarks/bench_backward.py --out "$out" --compile-budget-s 80 2>&1 | tee "$out/backward.log" | tail -22
       timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -rs \
         tests/test_qk_norm_rope_cache_kernel.py tests/test_qkv_rope_qk_norm_backward_kernel.py \
         tests/test_qk_norm_rope_cache_model.py 2>&1 | tee "$out/gpu-tests.log" | tail -15 ;;
  quick) timeout 100 python3 benchmarks/bench_forward.py --out "$out" --cases quick --no-sweep 2>&1 | tee "$out/forward.log" | tail -12
       timeout 60 python3 -m pytest -q -p no:cacheprovider -x tests/test_qk_norm_rope_cache_kernel.py 2>&1 | tail -6 ;;
  all) timeout 380 python3 benchmarks/bench_forward.py --out "$out" --no-sweep 2>&1 | tee "$out/forward.log" | tail -25
       run_tests ;;
esac
