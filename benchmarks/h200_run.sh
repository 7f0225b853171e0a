#!/usr/bin/env bash
# One device-machine session: GPU tests, the fuzzer, the soak, the layer benchmark, a per-kernel profile and the
# bare-stream floor (benchmarks/stream_floor.py, built here with nvcc), each
# writing its record (and log) into OUT. Run from the repository root of a tree whose
# build/sm90 holds the built library; wheels for packages the machine lacks (cuda-python) in
# WHEELS. Copy the records from OUT into benchmarks/results/ afterwards.
#   MOE_CUTLASS_COMMIT=<sha> OUT=/tmp/out WHEELS=.whl bash benchmarks/h200_run.sh [bench args...]
set -uo pipefail
: "${OUT:?set OUT}"
if compgen -G "${WHEELS:-.whl}/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${WHEELS:-.whl}"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
status=0
# -p no:logging: torch.compile's debug records would bury the failures
timeout 330 python3 -m benchmarks.run_gpu_tests --out-dir "$OUT" tests -m gpu -p no:cacheprovider -p no:logging -q \
  2>&1 | tee "$OUT/tests.log" | tail -5 || status=1
timeout 120 python3 -m benchmarks.fuzz --configs 1000 --time-budget 90 --out-dir "$OUT" 2>&1 | tail -2 || status=1
timeout 120 python3 -m benchmarks.soak --out-dir "$OUT" 2>&1 | tee "$OUT/soak.log" | tail -2 || status=1
timeout 170 python3 -m benchmarks.bench_moe --out-dir "$OUT" --reps 50 "$@" 2>&1 | tee "$OUT/bench.log" | grep graph \
  || status=1
timeout 90 python3 -m benchmarks.bench_gemm --out-dir "$OUT" --shapes gptoss_decode_m4,dsv3_decode_m4,gptoss_m2048 --reps 30 \
  > "$OUT/bench_gemm.log" 2>&1 || status=1
timeout 60 python3 -m benchmarks.profile_stages --out-dir "$OUT" --configs qwen3-30b-a3b,dsv3 --ms 1,64,1024,4096 \
  > "$OUT/profile.log" 2>&1 || status=1
timeout 90 python3 -m benchmarks.stream_floor --out-dir "$OUT" > "$OUT/stream_floor.log" 2>&1 || status=1
exit $status
