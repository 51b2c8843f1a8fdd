#!/usr/bin/env bash
# The on-GPU check of the gated delta rule's Hopper kernel, in one bounded command (< 8 minutes on
# an H200; the stage limits add up to 455 s). From the repository root:
#
#     OUT=/tmp/gpu_check bash benchmarks/gpu_check.sh
#
# Stages, each in its own process under its own timeout so that a crash or a hang of one does not
# end the run (a stage's failure is recorded in summary.md and the next stage starts):
#   env       versions, the device, the lowering semantics
#   tests     the kernel and op tests compiled for the chip (SEQLAB_GPU_KERNELS=compiled):
#             tests/kernels/test_gated_delta_gpu.py and the pallas_gpu cases of
#             tests/ops/test_gated_delta_trained_like.py (correlated keys, all gradients)
#   auto      what `impl=None` gives on the chip for the head sizes of seqlab's models (K, V, chunk),
#             against "chunked"
#   launch    a short MQAR training run of Gated DeltaNet by the launcher (impl=None inside)
#   accuracy  benchmarks/gated_delta_accuracy.py --quick --compiled: pallas_gpu and chunked against the
#             float64 recurrence, float32 and bfloat16, every gradient, trained-model-like inputs
#   bench     benchmarks/gated_delta_gpu.py: pallas_gpu, chunked and flash-linear-attention (when
#             installed), forward and forward+backward, first-call (compile) times
# Knobs: GPU_CHECK_STAGES (default: all, in this order), GPU_CHECK_PYTHON (python3),
# GPU_CHECK_TESTS (pytest -k of the tests stage), GPU_CHECK_BENCH_ARGS (extra arguments of
# gated_delta_gpu.py). Writes $OUT/summary.md and one
# log per stage; exits 0 when every stage passed, else 1.
set -u
OUT="${OUT:-/tmp/gpu_check}"
PY="${GPU_CHECK_PYTHON:-python3}"
STAGES="${GPU_CHECK_STAGES:-env,tests,auto,launch,accuracy,bench}"
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
  grep -v '^[IW][0-9]\{4\} ' "$OUT/$name.log" | tail -n 60 >> "$summary"  # less absl logging
  echo '```' >> "$summary"
}

stage env 30 "$PY" -c '
import sys, jax
from jax.experimental.pallas import mosaic_gpu as plgpu
from seqlab.kernels.gated_delta import pallas_gpu
print("python", sys.version.split()[0], "jax", jax.__version__, "backend", jax.default_backend())
print("devices", jax.devices(), "compute capability", getattr(jax.devices()[0], "compute_capability", None))
print("default semantics", plgpu.CompilerParams().lowering_semantics, "kernel uses", pallas_gpu.COMPILER_PARAMS.lowering_semantics)
'
stage tests 120 "$PY" -m pytest -q -p no:cacheprovider -m "slow or not slow" --durations=10 \
  tests/kernels/test_gated_delta_gpu.py tests/ops/test_gated_delta_trained_like.py \
  -k "${GPU_CHECK_TESTS:-not pallas_tpu}"
stage auto 45 "$PY" -c '
import jax, jax.numpy as jnp
from seqlab.ops import gated_delta_rule
from seqlab.ops.gated_delta import resolve_impl
for kd, vd, c in [(128, 128, 64), (128, 256, 64), (64, 64, 128), (32, 96, 64), (256, 512, 64), (32, 64, 32), (200, 400, 64)]:
    ks = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(ks[0], (2, 1000, 4, kd), jnp.bfloat16)
    k = q / jnp.linalg.norm(q.astype(jnp.float32), axis=-1, keepdims=True).astype(q.dtype)
    v = jax.random.normal(ks[2], (2, 1000, 4, vd), jnp.bfloat16)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (2, 1000, 4)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (2, 1000, 4)))
    try:
        print(f"K={kd} V={vd} chunk={c}: impl=None is", resolve_impl(None, q.dtype, kd, vd, c))
        o = gated_delta_rule(q, k, v, g, beta, chunk_size=c)[0].astype(jnp.float32)
        ref = gated_delta_rule(q, k, v, g, beta, chunk_size=c, impl="chunked")[0].astype(jnp.float32)
        err = float(jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref))
        print(f"K={kd} V={vd} chunk={c}: impl=None ran, rel. error vs chunked {err:.2e}")
    except Exception as e:
        print(f"K={kd} V={vd} chunk={c}: impl=None FAILED: {type(e).__name__}: {str(e)[:200]}")
'
stage launch 50 "$PY" -m experiments.launch --config=experiments/configs/mqar.py:model=gdn \
  --config.total_steps=60 --config.optimizer.warmup_steps=10 --config.log_every=20 --workdir="$(mktemp -d)"
stage accuracy 70 "$PY" benchmarks/gated_delta_accuracy.py --quick --compiled --impls=chunked,pallas_gpu
# shellcheck disable=SC2086
stage bench 140 "$PY" benchmarks/gated_delta_gpu.py --repeats 5 --warmup 1 ${GPU_CHECK_BENCH_ARGS:-}
cat "$summary"
exit $status
