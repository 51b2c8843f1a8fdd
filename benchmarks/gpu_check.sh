#!/usr/bin/env bash
# The on-GPU check of the gated delta rule's Hopper kernel, in one bounded command (< 8 minutes on
# an H200). From the repository root:
#
#     OUT=/tmp/gpu_check bash benchmarks/gpu_check.sh
#
# Stages, each in its own process under its own timeout so that a crash or a hang of one does not
# end the run (a stage's failure is recorded in summary.md and the next stage starts):
#   env       versions, the device, the lowering semantics
#   tests     the kernel and op tests compiled for the chip (SEQLAB_GPU_KERNELS=compiled):
#             tests/kernels/test_gated_delta_gpu.py and the pallas_gpu cases of
#             tests/ops/test_gated_delta_trained_like.py (correlated keys, all gradients)
#   accuracy  benchmarks/gated_delta_accuracy.py --compiled: pallas_gpu and chunked against the
#             float64 recurrence, float32 and bfloat16, every gradient, trained-model-like inputs
#   bench     benchmarks/gated_delta_gpu.py: pallas_gpu, chunked and flash-linear-attention (when
#             installed), forward and forward+backward, first-call (compile) times
# Knobs: GPU_CHECK_STAGES (default env,tests,accuracy,bench), GPU_CHECK_PYTHON (python3),
# GPU_CHECK_BENCH_ARGS (extra arguments of gated_delta_gpu.py). Writes $OUT/summary.md and one
# log per stage; exits 0 when every stage passed, else 1.
set -u
OUT="${OUT:-/tmp/gpu_check}"
PY="${GPU_CHECK_PYTHON:-python3}"
STAGES="${GPU_CHECK_STAGES:-env,tests,accuracy,bench}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}" SEQLAB_GPU_KERNELS=compiled
summary="$OUT/summary.md"
echo "# gpu_check $(date -u +%FT%TZ), commit $(git log -1 --format=%h 2>/dev/null || echo '?')" \
  > "$summary"
status=0

stage() {  # stage NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  case ",$STAGES," in *",$name,"*) ;; *) return 0 ;; esac
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local verdict=pass
  [ $rc -eq 0 ] || { verdict="FAIL (rc=$rc$([ $rc -ge 124 ] && echo ', timed out'))"; status=1; }
  echo "## $name: $verdict, $((SECONDS - start)) s" >> "$summary"
  echo '```' >> "$summary"
  tail -n 60 "$OUT/$name.log" >> "$summary"
  echo '```' >> "$summary"
}

stage env 60 "$PY" -c '
import sys, jax
from jax.experimental.pallas import mosaic_gpu as plgpu
from seqlab.kernels.gated_delta import pallas_gpu
print("python", sys.version.split()[0], "jax", jax.__version__, "backend", jax.default_backend())
print("devices", jax.devices(), "compute capability", getattr(jax.devices()[0], "compute_capability", None))
print("default semantics", plgpu.CompilerParams().lowering_semantics, "kernel uses", pallas_gpu.COMPILER_PARAMS.lowering_semantics)
'
stage tests 180 "$PY" -m pytest -q -p no:cacheprovider -m "slow or not slow" -x --durations=10 \
  tests/kernels/test_gated_delta_gpu.py tests/ops/test_gated_delta_trained_like.py -k "not pallas_tpu"
stage accuracy 120 "$PY" benchmarks/gated_delta_accuracy.py --compiled --impls=chunked,pallas_gpu
# shellcheck disable=SC2086
stage bench 240 "$PY" benchmarks/gated_delta_gpu.py --repeats 5 --warmup 1 ${GPU_CHECK_BENCH_ARGS:-}
cat "$summary"
exit $status
