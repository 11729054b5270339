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
# two-rank spawn test left out; SANITIZE_TOOLS, default "memcheck racecheck"), native
# (benchmarks/native_check.py: may CUDA layers take the C++ path by default? Its own build,
# tests, speed and figures in at most 7 minutes, each step's result written under $OUT as it
# ends, the verdict from those files; see that file's docstring). No step: only the build. Full
# outputs go to $OUT (default ./gpu_out); the console gets tails.
# Exits 1 naming the steps that failed (a test, a sanitizer finding, a benchmark that crashed).
# The extension is built first, for the GPU's architecture (TORCH_CUDA_ARCH_LIST, default 9.0),
# with SYNCBN_REQUIRE_CUDA_BUILD=1: a build without its CUDA kernels ends the run at once, naming
# why, instead of every GPU test failing on it.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi -L; python -c "import torch; print(torch.__version__, torch.version.cuda)"; } 2>&1 |
  tee "$OUT/env.txt"
if [ "$*" = native ]; then
  # Its own build, within its deadline; NATIVE_CHECK_ARGS: a dry run's --canned and --timeout.
  # shellcheck disable=SC2086
  exec python benchmarks/native_check.py --out "$OUT" ${NATIVE_CHECK_ARGS:-}
fi
t0=$(date +%s)
if ! SYNCBN_REQUIRE_CUDA_BUILD=1 python -c "from syncbn_lightning.ops import build as b; print(b.load_extension())" \
  >"$OUT/build.txt" 2>&1; then
  tail -5 "$OUT/build.txt"
  echo "FAILED: build (outputs in $OUT): nothing else runs"
  exit 1
fi
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
    # shellcheck disable=SC2086
    python benchmarks/native_check.py --out "$OUT" ${NATIVE_CHECK_ARGS:-} || failed+=("native")
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
