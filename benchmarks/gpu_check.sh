#!/usr/bin/env bash
# One-shot check on a machine with one CUDA GPU, in under 10 minutes: the MoE layer against its GEMM
# bound (device and host paths, DeepSpeed if installed) and its profile (top kernels, device-to-host
# syncs), block-sparse attention and NSA, ZeRO-3 offload (with the delayed update at a batch whose
# backward outlasts the host step), the recipe on a ~1B dense Llama and a Qwen3-30B-A3B-shaped MoE
# scaled to ~2.5B (bf16: tokens/s, MFU, peak memory), the GPU-marked tests and Ulysses at sp=1. Every
# figure goes to stdout and to one results file; the headline figures also to benchmarks/gpu_results.json.
#
#   bash benchmarks/gpu_check.sh [results_file]   # default: runs/gpu_check-<time>/gpu_check_results.txt
#
# Needs only the PyTorch it finds: the repo goes on PYTHONPATH (no `pip install -e .`), and missing
# pure-Python packages (hydra-core, omegaconf, pytest, ...) come from benchmarks/wheels into a
# throwaway folder, never from the network. Without a GPU it says so and exits 0. See gpu_check.md.
set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
PY=${PYTHON:-}
if [[ -z $PY ]]; then  # the first interpreter on PATH that has torch ($PYTHON chooses one)
  for candidate in python python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c 'import torch' 2>/dev/null; then
      PY=$(command -v "$candidate")
      break
    fi
  done
  PY=${PY:-$(command -v python3 || command -v python)}
fi
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}  # all parts; 60 s left of the 10 minutes for start-up and clean-up
# GPU_CHECK_SMOKE=1 runs every part on the CPU at tiny sizes: a test of this script, not a measurement.
SMOKE=${GPU_CHECK_SMOKE:-0}

if [[ $SMOKE != 1 ]] && { [[ -z "$PY" ]] || ! "$PY" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; }; then
  found=$("${PY:-python3}" -c 'import torch; print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}")' \
          2>/dev/null || echo "no importable torch")
  echo "gpu_check: no CUDA GPU visible to PyTorch (${PY:-no python}: $found); nothing to check on this machine."
  exit 0
fi

RUN_DIR=${GPU_CHECK_RUN_DIR:-$ROOT/runs/gpu_check-$(date +%Y%m%d-%H%M%S)}
RESULTS=${1:-$RUN_DIR/gpu_check_results.txt}
mkdir -p "$RUN_DIR" "$(dirname "$RESULTS")"
RESULTS=$(cd "$(dirname "$RESULTS")" && pwd)/$(basename "$RESULTS")
: >"$RESULTS"
# the machine-readable figures: the repository's file on a GPU, the run folder's in a smoke run
JSON=${GPU_CHECK_JSON:-$ROOT/benchmarks/gpu_results.json}
PYDEPS=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_pydeps.XXXXXX")
trap 'rm -rf "$PYDEPS"' EXIT
export PYTHONPATH="$ROOT:$PYDEPS${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

say() { echo "$*" | tee -a "$RESULTS"; }
has() { "$PY" -c "import $1" 2>/dev/null; }

# run_part NAME LIMIT_S CMD...: CMD under `timeout`, capped by what is left of the budget; its output
# goes to stdout and $RUN_DIR/NAME.log (its figures reach $RESULTS through --results).
run_part() {
  local name=$1 limit=$2 left rc
  shift 2
  left=$((BUDGET_S - SECONDS))
  if ((left < 20)); then
    say "[$name] skipped: the ${BUDGET_S} s budget is spent"
    return 1
  fi
  ((limit > left)) && limit=$left
  say ""
  say "== $name (limit ${limit} s, ${SECONDS} s into the check)"
  timeout -k 15 "$limit" "$@" 2>&1 | tee "$RUN_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  if ((rc == 124 || rc == 137)); then
    say "[$name] stopped at the ${limit} s limit"
  elif ((rc != 0)); then
    say "[$name] failed (exit $rc); last lines of $RUN_DIR/$name.log:"
    tail -n 5 "$RUN_DIR/$name.log" | sed 's/^/    /' | tee -a "$RESULTS"
  fi
  return "$rc"
}

say "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
say "results: $RESULTS; logs and recipe runs: $RUN_DIR"
device_args=()
recipe_size=(train.steps=30)
if [[ $SMOKE == 1 ]]; then
  say "SMOKE RUN (GPU_CHECK_SMOKE=1): CPU, tiny sizes; the figures below measure nothing"
  device_args=(--device cpu --dtype float32 --smoke)
  recipe_size=(train.steps=6 train.micro_batch_size=4 train.seq_len=128 data.max_bytes=2000000)
  JSON=${GPU_CHECK_JSON:-$RUN_DIR/gpu_results.json}
fi
device_args+=(--json "$JSON")
run_part env 40 "$PY" benchmarks/gpu_check.py env --results "$RESULTS" "${device_args[@]}"

# ---- pure-Python packages from benchmarks/wheels, only those that do not import
say ""
say "== python packages"
wheels=()
has "hydra, omegaconf" || wheels+=(hydra-core omegaconf antlr4-python3-runtime)
if ! has pytest; then
  wheels+=(pytest pluggy iniconfig)
  "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || wheels+=(exceptiongroup tomli)
fi
((${#wheels[@]})) && ! has packaging && wheels+=(packaging)
if ((${#wheels[@]})); then
  files=()
  for w in "${wheels[@]}"; do files+=("$ROOT"/benchmarks/wheels/"${w//-/_}"-*.whl); done
  if ! "$PY" -m pip install --isolated --no-index --no-deps --disable-pip-version-check -q \
      --target "$PYDEPS" "${files[@]}" >"$RUN_DIR/pydeps.log" 2>&1; then
    # No pip: a pure-Python wheel unpacked onto sys.path is an installed package.
    for f in "${files[@]}"; do "$PY" -m zipfile -e "$f" "$PYDEPS" || say "could not unpack $f"; done
  fi
  say "installed from benchmarks/wheels into $PYDEPS: ${wheels[*]}"
fi
missing=()
for m in hydra omegaconf yaml numpy psutil pytest matplotlib; do has "$m" || missing+=("$m"); done
say "python packages missing: ${missing[*]:-none}"
# zero/engine.py imports psutil, and moe and sequence_parallel import zero: without it only tests run.
has psutil || say "psutil is missing (a binary package, not brought): the MoE, Ulysses and recipe parts are skipped"

# ---- 1. MoE layer and its profile, block-sparse attention and NSA, ZeRO-3 offload (torch only)
if has psutil; then
  run_part moe_layer 80 "$PY" benchmarks/gpu_check.py moe --results "$RESULTS" "${device_args[@]}"
  run_part moe_profile 40 "$PY" benchmarks/gpu_check.py moe_profile --results "$RESULTS" "${device_args[@]}"
fi
run_part sparse 70 "$PY" benchmarks/gpu_check.py sparse --results "$RESULTS" "${device_args[@]}"
if has psutil; then
  run_part offload 150 "$PY" benchmarks/gpu_check.py offload --results "$RESULTS" "${device_args[@]}"
fi

# ---- 2. recipe: a ~1B dense Llama and a Qwen3-30B-A3B-shaped MoE scaled to ~2.5B (24 layers, dim 1024,
# 64 experts of ffn 512, top-8), bf16, 2048-token sequences
recipe_args=(zero.dtype=bf16 train.eval_every=0 train.eval_batches=1 train.sample_tokens=0
             train.progress=false wandb.mode=disabled "${recipe_size[@]}")
dense=(model=llama_1b train.seq_len=2048 train.micro_batch_size=8 train.steps=20)
moe=(model=llama_1b model.dim=1024 model.n_layers=24 model.n_heads=8 model.n_kv_heads=4 model.moe.num_experts=64
     model.moe.top_k=8 model.moe.ffn_dim=512 model.moe.aux_loss_coef=0.001 train.seq_len=2048
     train.micro_batch_size=4 train.steps=20)
if [[ $SMOKE == 1 ]]; then
  dense=(model=tiny)
  moe=(model=moe_tiny)
fi
if ! has "hydra, omegaconf, yaml, numpy, psutil"; then
  say "[recipe] skipped: it needs hydra, omegaconf, yaml, numpy and psutil (missing: ${missing[*]})"
else
  run_part recipe_dense 100 "$PY" benchmarks/gpu_check.py recipe --results "$RESULTS" --json "$JSON" --key dense \
    --run-dir "$RUN_DIR/recipe_dense" --label "${dense[0]} dense" "${dense[@]}" "${recipe_args[@]}"
  # The recipe ends with a checkpoint (fp32 masters and Adam state: ~12 GB here, ~30 GB for the MoE); the
  # figures are in metrics.jsonl, so the checkpoints go at once to keep the disk free.
  rm -rf "$RUN_DIR"/recipe_dense/checkpoints
  if ! has matplotlib; then  # MoE runs end with an expert-load plot
    say "[recipe_moe] skipped: matplotlib is missing"
  else
    run_part recipe_moe 110 "$PY" benchmarks/gpu_check.py recipe --results "$RESULTS" --json "$JSON" --key moe \
      --run-dir "$RUN_DIR/recipe_moe" --label "${moe[0]} MoE" "${moe[@]}" "${recipe_args[@]}"
    rm -rf "$RUN_DIR"/recipe_moe/checkpoints
  fi
fi

# ---- 3. GPU-marked tests (collection errors in modules without gpu tests do not stop the rest)
if has pytest; then
  run_part tests 90 "$PY" -m pytest -q -m gpu tests -p no:cacheprovider --continue-on-collection-errors -rfEs
  rc=$?
  if ((rc == 5)); then
    say "[tests] no test is marked gpu"
  elif ((rc != 124 && rc != 137)) && [[ -f $RUN_DIR/tests.log ]]; then
    # pytest's short summary (failures, errors, skips with reasons) and its final count line
    sed -n '/short test summary info/,$p' "$RUN_DIR/tests.log" | grep -v 'short test summary info' \
      | tee -a "$RESULTS" >/dev/null
    grep -q 'short test summary info' "$RUN_DIR/tests.log" || tail -n 1 "$RUN_DIR/tests.log" >>"$RESULTS"
  fi
else
  say "[tests] skipped: pytest is not importable"
fi

# ---- 4. Ulysses attention at sp=1 against SDPA
if has psutil; then
  run_part ulysses 40 "$PY" benchmarks/gpu_check.py ulysses --results "$RESULTS" "${device_args[@]}"
fi

say ""
say "gpu_check done in ${SECONDS} s; results: $RESULTS; figures: $JSON"
exit 0
