#!/bin/bash
# Every GPU check of the project in one run (a lent GPU is handed back soon after each call):
#
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh tests layer model sanitize
#
# Steps, in the order given: tests (pytest -m gpu over every file with a gpu test, or the files
# GPU_TEST_FILES names, in that order, within TESTS_TIMEOUT s, default 300), layer
# (bench_layer.py; LAYER_ARGS adds options, e.g. "--profile"), model (bench_model.py: fp32 NCHW
# b64, bf16 channels-last b32/b128 or MODEL_BF16_BATCH; every BN implementation, the fused
# residual tails included), profile (profile_eager.py: where an eager ResNet-50 bf16-cl
# b32 step's host time goes, per BN layer, plain / ours gather / ours reduce / torch SyncBN; the
# syncs with their Python stacks, traces and tables in $OUT/profile.tgz), sanitize (compute-
# sanitizer over the non-slow tests of test_cuda.py, test_cuda_act.py, test_cuda_fused.py and
# test_cuda_residual.py, the
# two-rank spawn test left out; SANITIZE_TOOLS, default "memcheck racecheck"), native (CUDA layers
# on the C++ path, SYNCBN_NATIVE_CUDA=1, in at most 8 minutes on one H100 or H200, the build's
# ~35 s included: its tests, -m "gpu and not slow" over test_cuda_native.py (bitwise the Python
# path, 0 host syncs per step on NCCL, graph replay equal to eager, a skipped layer found before
# the step's last call, one compiled graph) and the layer's GPU test files again on that path
# (GPU_NATIVE_FILES, default test_cuda.py and test_cuda_residual.py), within 150 s; the host
# goal, bench_host.py --device cuda: unprofiled µs per layer step, plain BatchNorm / the floor
# (plain BatchNorm + the same two collectives straight on the ProcessGroup) / ours / ours_native,
# goal ours_native <= 1.1x the floor; profile_eager.py with ours_native (where the host time goes,
# no verdict); bench_model.py ResNet-50 eager, medians of 5 interleaved rounds at bf16-cl b32 and
# fp32 b64, plain / ours_native / ours / torch SyncBatchNorm, goals ours_native <= 1.3x plain and
# torch_sync >= 2x ours_native (only the ours_native lines decide). The last line says whether
# CUDA layers may take the C++ path by default). No step: only the build. Full outputs go to $OUT
# (default ./gpu_out); the console gets tails.
# Exits 1 naming the steps that failed (a test, a sanitizer finding, a benchmark that crashed).
# The extension is built first, for the GPU's architecture (TORCH_CUDA_ARCH_LIST, default 9.0).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi -L; python -c "import torch; print(torch.__version__, torch.version.cuda)"; } 2>&1 |
  tee "$OUT/env.txt"
t0=$(date +%s)
python -c "from syncbn_lightning.ops import build as b; print(b.load_extension())" >"$OUT/build.txt" 2>&1
echo "build $(($(date +%s) - t0)) s" >>"$OUT/build.txt"
tail -2 "$OUT/build.txt"
failed=()
for step in "$@"; do
  echo "== $step"
  t0=$(date +%s)
  case $step in
  tests)
    # Every test file with a gpu-marked test (not all of tests/: the GPU image lacks the
    # service's dependencies, so the service's test files would not even import there).
    if [ -n "${GPU_TEST_FILES:-}" ]; then
      read -r -a files <<<"$GPU_TEST_FILES"
    else
      mapfile -t files < <(grep -l "pytest.mark.gpu" tests/test_*.py)
    fi
    timeout "${TESTS_TIMEOUT:-300}" python -m pytest -q -p no:cacheprovider -m gpu "${files[@]}" \
      >"$OUT/tests.txt" 2>&1 || failed+=("tests")
    tail -4 "$OUT/tests.txt"
    ;;
  layer)
    # shellcheck disable=SC2086
    timeout 240 python benchmarks/bench_layer.py ${LAYER_ARGS:-} >"$OUT/layer.md" 2>&1 ||
      failed+=("layer")
    tail -25 "$OUT/layer.md"
    ;;
  model)
    timeout 200 python benchmarks/bench_model.py --configs fp32-nchw --batch 64 \
      >"$OUT/model_fp32.md" 2>&1 || failed+=("model fp32")
    tail -9 "$OUT/model_fp32.md"
    timeout 250 python benchmarks/bench_model.py --configs bf16-cl --batch "${MODEL_BF16_BATCH:-32,128}" \
      >"$OUT/model_bf16.md" 2>&1 || failed+=("model bf16")
    tail -14 "$OUT/model_bf16.md"
    ;;
  profile)
    timeout 300 python benchmarks/profile_eager.py --out "$OUT/profile" >"$OUT/profile.md" 2>&1 ||
      failed+=("profile")
    # One archive: the device tool returns at most 8 files per call.
    tar -czf "$OUT/profile.tgz" -C "$OUT" profile && rm -rf "$OUT/profile"
    grep -v "^USDT\|profiler_st" "$OUT/profile.md" | tail -24
    ;;
  sanitize)
    for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
      timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 9 python -m pytest -q \
        -p no:cacheprovider -m "gpu and not slow" -k "not two_ranks" tests/test_cuda.py \
        tests/test_cuda_act.py tests/test_cuda_fused.py tests/test_cuda_residual.py \
        >"$OUT/sanitizer_$tool.txt" 2>&1
      rc=$?
      echo "$tool rc=$rc"
      [ "$rc" -eq 0 ] || failed+=("$tool")
      grep -E "SUMMARY|passed|failed" "$OUT/sanitizer_$tool.txt" | tail -2
    done
    ;;
  native)
    export SYNCBN_NATIVE_CUDA=1
    # The budget (8 min at most, the build's ~35 s included): 150 s of tests, 45 s of host
    # timings, 80 s of profile, 2 x 85 s of whole-network timings.
    read -r -a files <<<"${GPU_NATIVE_FILES:-tests/test_cuda.py tests/test_cuda_residual.py}"
    timeout 150 python -m pytest -q -p no:cacheprovider -m "gpu and not slow" \
      tests/test_cuda_native.py "${files[@]}" >"$OUT/native_tests.txt" 2>&1 ||
      failed+=("native tests")
    tail -4 "$OUT/native_tests.txt"
    timeout 45 python benchmarks/bench_host.py --device cuda --rounds 7 --steps 300 \
      >"$OUT/native_host.md" 2>&1 || failed+=("native host")
    tail -16 "$OUT/native_host.md"
    grep -q "^PASS ours_native" "$OUT/native_host.md" || failed+=("native host goal")
    timeout 80 python benchmarks/profile_eager.py --impls plain,ours,ours_native,torch_sync \
      --out "$OUT/native_profile" >"$OUT/native_profile.md" 2>&1 || failed+=("native profile")
    tar -czf "$OUT/native_profile.tgz" -C "$OUT" native_profile && rm -rf "$OUT/native_profile"
    grep -v "^USDT\|profiler_st" "$OUT/native_profile.md" | tail -22
    for cfg in "bf16-cl 32" "fp32-nchw 64"; do
      read -r config batch <<<"$cfg"
      timeout 85 python benchmarks/bench_model.py --configs "$config" --batch "$batch" \
        --modes eager --rounds 5 --steps 10 --warmup 3 \
        --impls plain,ours,ours_native,ours_native_fused,torch_sync \
        >"$OUT/native_model_$config.md" 2>&1 || failed+=("native model $config")
      tail -12 "$OUT/native_model_$config.md"
      # Only the C++ path's goals decide (the Python path's lines are printed, not judged here).
      ! grep -q "^FAIL .*ours_native" "$OUT/native_model_$config.md" ||
        failed+=("native goals $config")
    done
    unset SYNCBN_NATIVE_CUDA
    if [[ " ${failed[*]:-} " == *" native"* ]]; then
      echo "native: NOT passed: CUDA layers keep the Python path by default"
    else
      echo "native: PASSED: CUDA layers may take the C++ path by default"
    fi
    ;;
  *)
    echo "unknown step $step (tests, layer, model, profile, sanitize, native)"
    failed+=("$step")
    ;;
  esac
  echo "-- $step $(($(date +%s) - t0)) s"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]} (outputs in $OUT)"
  exit 1
fi
