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
  host6-review) # Session 6, call 5: after the review fixes (scalar types in the launch key, ROCm
       # off the fast path, the op's pt2 tag and double-backward guard): the launcher tests (new:
       # graph capture on a side stream, launch hooks), the backward kernels, the training step.
       log="$out/host6-review.log"
       timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_triton_launch.py \
         tests/test_qkv_rope_qk_norm_backward_kernel.py 2>&1 | tee -a "$log" | tail -3
       timeout 150 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_qkv_rope_qk_norm_numerics.py \
         2>&1 | tee -a "$log" | tail -2 ;;
  host6-models) # Session 6, call 4: with the cached launcher active (calls 1-3 found it off in call 1),
       # the forward op tests, every forward variant and the whole-model GPU tests (Qwen3 with the
       # pass, its CUDA-graph decode, the HunYuanDenseV1 training step); same-process host A/B.
       log="$out/host6-models.log"
       timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_qk_norm_rope_cache_op.py \
         tests/test_qk_norm_rope_cache_variants_gpu.py tests/test_triton_launch.py 2>&1 | tee -a "$log" | tail -2
       timeout 240 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_qk_norm_rope_cache_model.py \
         tests/test_qkv_rope_qk_norm_numerics.py 2>&1 | tee -a "$log" | tail -2
       timeout 90 python3 benchmarks/diagnose_launch_overhead.py --out "$out" 2>&1 | tee -a "$log" | grep -E "host us" ;;
  host6-final) # Session 6, call 3: the launcher tests after the argument-check fix, the GPU
       # training-step test (op now Library-registered), suite B with min-of-3 medians.
       log="$out/host6-final.log"
       timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/test_triton_launch.py 2>&1 | tee -a "$log" | tail -2
       timeout 120 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_qkv_rope_qk_norm_numerics.py \
         2>&1 | tee -a "$log" | tail -2
       timeout 330 python3 benchmarks/bench_backward.py --out "$out" \
         --stock-from benchmarks/results/2026-11-29-h200-backward-run2.json 2>&1 | tee -a "$log" | tail -4
       rm -f "$out"/*.partial.json ;;
  host6-tests) # Session 6, call 1: cached-handle launches (kernels/triton_launch.py), the leaner
       # wrappers and the Library-registered backward op: every GPU test they touch, the whole-
       # model tests (CUDA-graph decode included), launch costs. One log.
       log="$out/host6-tests.log"
       timeout 260 python3 -m pytest -q -p no:cacheprovider -rs tests/test_triton_launch.py \
         tests/test_qkv_rope_qk_norm_backward_kernel.py tests/test_qk_norm_rope_cache_kernel.py \
         tests/test_qk_norm_rope_cache_op.py tests/test_qk_norm_rope_cache_variants_gpu.py \
         tests/test_projection_backward.py 2>&1 | tee -a "$log" | tail -3
       timeout 200 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_qkv_rope_qk_norm_numerics.py \
         tests/test_qk_norm_rope_cache_model.py 2>&1 | tee -a "$log" | tail -3
       timeout 60 python3 benchmarks/diagnose_launch_overhead.py --out "$out" 2>&1 | tee -a "$log" | tail -4 ;;
  host6-bench) # Session 6, call 2: the launcher's GPU tests again (call 1 found the hook check
       # wrong for Triton 3.6), launch costs, suite B with the op as "ours" (host time per call).
       log="$out/host6-bench.log"
       timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_triton_launch.py \
         tests/test_qkv_rope_qk_norm_backward_kernel.py tests/test_qk_norm_rope_cache_kernel.py \
         tests/test_projection_backward.py 2>&1 | tee -a "$log" | tail -3
       timeout 60 python3 benchmarks/diagnose_launch_overhead.py --out "$out" 2>&1 | tee -a "$log" | tail -4
       timeout 300 python3 benchmarks/bench_backward.py --out "$out" \
         --stock-from benchmarks/results/2026-11-29-h200-backward-run2.json 2>&1 | tee -a "$log" | tail -4
       rm -f "$out"/*.partial.json ;;
  probe-gw) # Session 5: does grad_W's store overlap its MMAs? warp specialization, ncu of the table config.
       log="$out/probe-gw.log"
       timeout 150 python3 benchmarks/probe_grad_weight_overlap.py --out "$out" 2>&1 | tee -a "$log" | grep -E "^M="
       timeout 120 ncu --clock-control none --kernel-name regex:_grad_weight_tma --launch-skip 2 --launch-count 1 \
         --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
         python3 benchmarks/probe_grad_weight_overlap.py --calls 3 > "$out/ncu-gw.txt" 2>&1
       echo "ncu rc $?" | tee -a "$log"
       grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Registers|Achieved Occupancy|Stall|Warp Cycles Per Issued|Block Limit" \
         "$out/ncu-gw.txt" | head -24 | tee -a "$log" ;;
  final5) # Session 5, last call: projection + backward kernel GPU tests, training step, suite B with
       # the GEMM-route columns. One log (the device tool returns at most 8 files).
       log="$out/final5.log"
       timeout 220 python3 -m pytest -q -p no:cacheprovider -rs tests/test_projection_backward.py \
         tests/test_qkv_rope_qk_norm_backward_kernel.py 2>&1 | tee -a "$log" | tail -2
       timeout 120 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_qkv_rope_qk_norm_numerics.py \
         2>&1 | tee -a "$log" | tail -2
       timeout 230 python3 benchmarks/bench_backward.py --out "$out" \
         --stock-from benchmarks/results/2026-11-29-h200-backward-run2.json 2>&1 | tee -a "$log" | tail -3
       rm -f "$out"/*.partial.json ;;
  small-m) # Session 5: GEMM routes (two streams) and host cost per call at small M.
       timeout ${SMALLM_TIMEOUT:-300} python3 benchmarks/diagnose_small_m_backward.py --out "$out" 2>&1 \
         | tee "$out/small-m.log" | grep -vE "^\s*$" | head -80 ;;
  gemm-sweep) # Session 5: tiles of the small-M projection GEMMs against cuBLAS.
       timeout ${SWEEP_TIMEOUT:-220} python3 benchmarks/sweep_projection_gemms.py --out "$out" 2>&1 \
         | tee "$out/gemm-sweep.log" | grep -E "^M=|best|failed" ;;
  gpu-models) # Every GPU whole-model test; the CUDA-graph decode check (own processes) last.
       timeout 200 python3 -m pytest -q -p no:cacheprovider -rs -m gpu -k "not cuda_graphs" \
         tests/test_qk_norm_rope_cache_model.py tests/test_qkv_rope_qk_norm_numerics.py 2>&1 \
         | tee "$out/gpu-model-tests.log" | tail -3
       timeout 380 python3 -m pytest -q -p no:cacheprovider -rs -k cuda_graphs tests/test_qk_norm_rope_cache_model.py \
         2>&1 | tee -a "$out/gpu-model-tests.log" | tail -3 ;;
  cg5) # Session 4, call 5: the whole-model CUDA-graph test with static shapes and step marks.
       timeout 150 python3 -X faulthandler -m pytest -q -p no:cacheprovider -rs -k "whole_pass and reduce" \
         tests/test_qk_norm_rope_cache_model.py 2>&1 | tee "$out/cg5.log" | tail -2 ;;
  cg4) # Session 4, call 4: the whole-model CUDA-graph test with Inductor's static launcher off
       # (its crash is stock Inductor's), and the stock repro with the launcher off.
       log="$out/cg4.log"
       timeout 200 python3 -X faulthandler -m pytest -q -p no:cacheprovider -rs -k whole_pass \
         tests/test_qk_norm_rope_cache_model.py 2>&1 | tee -a "$log" | tail -2
       echo "== stock, static launcher off" | tee -a "$log"
       TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER=0 timeout 110 python3 -X faulthandler \
         benchmarks/diagnose_cudagraph_crash.py --stock 2>&1 | tee -a "$log" | grep -E "^ok|^compiling|Fatal" ;;
  final4) # Session 4, call 3: backward GPU tests + suite B with the v3/v5 rule, the training step,
       # and the reduce-overhead crash outside pytest (with the pass, then stock).
       log="$out/final4.log"
       timeout 130 python3 -m pytest -q -p no:cacheprovider -rs tests/test_qkv_rope_qk_norm_backward_kernel.py \
         2>&1 | tee -a "$log" | tail -2
       timeout 150 python3 benchmarks/bench_backward.py --out "$out" \
         --stock-from benchmarks/results/2026-11-29-h200-backward-run2.json 2>&1 | tee -a "$log" | tail -2
       rm -f "$out"/*.partial.json
       timeout 100 python3 benchmarks/bench_end_to_end.py --out "$out/e2e" --cases hunyuan_train_B2_S2048 2>&1 \
         | tee -a "$log" | grep -E "=>|ms/step"
       rm -f "$out"/e2e/*.png
       for variant in "" "--stock"; do
         echo "== diagnose_cudagraph_crash.py $variant" | tee -a "$log"
         timeout 110 python3 -X faulthandler benchmarks/diagnose_cudagraph_crash.py $variant > /tmp/crash.txt 2>&1
         echo "rc $?" | tee -a "$log"; cat /tmp/crash.txt >> "$log"
         grep -E "^ok|^compiling|Fatal Python|Segmentation" /tmp/crash.txt
         grep -A14 "Fatal Python error" /tmp/crash.txt | grep "File" | head -14
       done ;;
  bwd5) # Session 4: backward kernel v5 (token rows): GPU tests, variants, suite B; interleaved RoPE v2.
       # One log (the device tool returns at most 8 files).
       log="$out/bwd5.log"
       timeout 130 python3 -m pytest -q -p no:cacheprovider -rs tests/test_qk_norm_rope_cache_variants_gpu.py \
         tests/test_qk_norm_rope_cache_kernel.py 2>&1 | tee -a "$log" | tail -2
       timeout 60 python3 benchmarks/diagnose_device_time.py --out "$out/fwd" --sections variants 2>&1 \
         | tee -a "$log" | grep -E "qwen3|interleaved|paged"
       timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_qkv_rope_qk_norm_backward_kernel.py \
         2>&1 | tee -a "$log" | tail -3
       timeout 140 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_qkv_rope_qk_norm_numerics.py \
         2>&1 | tee -a "$log" | tail -2
       timeout 170 python3 benchmarks/diagnose_device_time.py --out "$out" --sections backward 2>&1 | tee -a "$log" \
         | grep -E "elementwise S=|v3 head|weights only|no w/cos|whole"
       timeout 150 python3 benchmarks/bench_backward.py --out "$out" \
         --stock-from benchmarks/results/2026-11-29-h200-backward-run2.json 2>&1 | tee -a "$log" | tail -3 ;;
  check4) # Session 4, call 1: GPU tests of every forward variant, the reduce-overhead test alone,
       # a profile of the backward elementwise pass, forward variant timings, the training step.
       timeout 150 python3 -m pytest -q -p no:cacheprovider -rs -s tests/test_qk_norm_rope_cache_variants_gpu.py \
         2>&1 | tee "$out/gpu-variant-tests.log" | grep -v "^$" | tail -8
       timeout 170 python3 -X faulthandler -m pytest -q -p no:cacheprovider -rs -k "reduce" \
         tests/test_qk_norm_rope_cache_model.py 2>&1 | tee "$out/reduce-overhead.log" | tail -6
       echo "reduce-overhead alone: rc ${PIPESTATUS[0]}" | tee -a "$out/reduce-overhead.log"
       for grads in both none; do
         timeout 60 ncu --clock-control none --kernel-name regex:_qk_norm_rope_bwd --launch-skip 1 --launch-count 1 \
           --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
           --section SchedulerStats --section MemoryWorkloadAnalysis \
           python3 benchmarks/profile_backward_elementwise.py --S 128 --B 64 --grads $grads > "$out/ncu-bwd-$grads.txt" 2>&1
         echo "ncu $grads: rc $?"; grep -E "Duration|Registers|Achieved Occupancy|Stall|Warp Cycles Per Issued" "$out/ncu-bwd-$grads.txt" | head -12
       done
       timeout 90 python3 benchmarks/diagnose_device_time.py --out "$out" --sections variants 2>&1 | tee "$out/diagnose.log" | tail -10
       timeout 150 python3 benchmarks/bench_end_to_end.py --out "$out" --cases hunyuan_train_B2_S2048 2>&1 \
         | tee "$out/end-to-end-train.log" | grep -E "=>|ms/step|fused ops" ;;
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
