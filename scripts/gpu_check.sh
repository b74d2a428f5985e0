#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU, as two commands for one warm H100/H200 lease (each well under the
# 10 minutes one command may run; about 15 minutes of device time in all, the machine's start included):
#
#   OUT=results/gpu bash scripts/gpu_check.sh key      # 198 s on an H200 (budget KEY_BUDGET=280 s)
#   OUT=results/gpu bash scripts/gpu_check.sh tests    # ~5.5 min (budget TESTS_BUDGET=380 s)
#   OUT=results/gpu bash scripts/gpu_check.sh models   # GPT-2 small rows, not yet timed (MODELS_BUDGET=560 s)
#
# models does not fit one lease beside the other two: it is a lease of its own. Its fine-tuning comparison alone,
# without the sm_90 build (Triton kernels, compiled in each method's first step; estimated 3-4 min):
#   PYTHONPATH=python python3 bench/finetune.py --task text --model gpt2-small --device cuda --out "$OUT"
#
# Measured on an H200 (2026-11-27, code 805cda4): the sm_90 build 81 s, key 198 s in all (the build, the
# optimizer-step rows 38 s, the kernel rows 47 s), tests: the CUDA part 120 s and the Triton part 154 s with 16
# workers (GPU_TEST_WORKERS, default 16) from a cold JIT cache, compute-sanitizer memcheck 27 s.
#
# key:   a GPU gate (stops with exit 3 when torch sees no GPU), the sm_90 build into .gpu/ (kept for
#        `tests` on the same machine; on a build failure the Triton rows still run), the tangent-cost
#        microbenchmark (bench/gaussian_roof.cu, K = 1 and 4), then the key rows of bench/kernel_bench.py,
#        backend by backend, each row written to the CSV and printed as it is measured: copy, eager, the
#        CUDA kernels, Triton, then torch.compile (AFGFW at 1e8) last. Cases: 1e6 and 1e8 parameters in one
#        tensor, the 200-tensor model, the 12 x 1024 MLP with row balls (the optimizer's call: whole
#        tensors with row_numel), for AFGFW, FGFW and backprop FW; AFGFW with 4 Gaussian tangents at 1e8.
#        Also a torch.profiler table of one lean AFGFW step on GPT-2 small (scripts/profile_lean_step.py), and
#        the attention JVP rows (bench/attention_jvp.py: fused kernel, chunked rule, SDPA forward; not yet timed,
#        45 s guard). Returns summary.txt, build.log, gaussian_roof.txt, kernel_gpu.csv, kernel_gpu.log,
#        kernel_gpu.png, optimizer_step_gpu.csv, lean_profile.txt, lean_profile_tf32.txt, attention_jvp_gpu.csv.
# tests: the tests that need a GPU (pytest --gpu-only: CUDA kernels, compiled Triton, CUDA graphs, the
#        property tests on cuda and triton; CI runs the rest) with FGFW_REQUIRE_CUDA_KERNELS=1, a per-test
#        timeout and pytest-xdist; then compute-sanitizer memcheck (caching allocator off) and racecheck
#        on scripts/gpu_sanitize.py, where the sanitizer works on this machine (checked first, said
#        either way); then, if time is left, bench/memory.py --quick and torch.compile rows for FGFW and FW.
#        Returns summary.txt, tests_cuda.log, tests_triton.log, sanitizer.log, memory_gpu.csv,
#        kernel_gpu_compile.csv, extra.log (both benchmarks' output), and build.log when it had to build.
# models: issue 30's GPT-2 small rows (bench/real_models.py: time and peak memory of each method's step, each case a
#        process; what is left of the budget after the fine-tuning's reserve), then issue 31's fine-tuning comparison
#        (bench/finetune.py --model gpt2-small: pre-training, then MeZO, AFGFW, FGFW, FrankWolfe and Adam fine-tuned,
#        each with its time per pass and peak memory beside MeZO's; estimated 3 min, 270 s reserved). Returns
#        summary.txt, real_models_gpu.csv, real_models_gpu.log, finetune_text_gpt2_small_cuda.csv,
#        finetune_gpt2_small.log, and build.log when it had to build.
#
# Every step runs under `timeout` with limit = min(its own, deadline - now - margin), where the deadline is
# the command's budget from its start; a step with under 10 s left is skipped and said so. The summary's
# last lines are the result tables, so the tool's output tail carries them.
#
# GPU_CHECK_DRY_RUN=1 (CI, no GPU): every step runs its CPU stand-in instead, so that a change that would break a
# step on the GPU machine (an op's schema, a script's arguments, a test that no longer collects) breaks CI:
# no sm_90 build (the installed fgfw is used), gaussian_roof.cu compiled but not run, the kernel benchmark's rows
# on the CPU at 1e4, the GPU tests collected (not run), scripts/gpu_sanitize.py on the CPU kernels; memory.py and
# the compile rows are left out (tests/test_bench_scripts.py runs both benchmarks on the CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:-}
case "$phase" in
  key) budget=${KEY_BUDGET:-280} ;;
  tests) budget=${TESTS_BUDGET:-380} ;;
  models) budget=${MODELS_BUDGET:-560} ;;
  *) echo "usage: OUT=dir bash scripts/gpu_check.sh key|tests|models" >&2; exit 2 ;;
esac
out=${OUT:-results/gpu}
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
export PYTHONUNBUFFERED=1
started=$(date +%s)
deadline=$((started + budget))
margin=10
status=0

say() { echo "$*" | tee -a "$summary"; }

# run NAME SECONDS CMD...: CMD under a timeout of min(SECONDS, time to the deadline less the margin);
# records its exit status and time in the summary. Returns 124 without running when under 10 s are left.
run() {
  local name=$1 limit=$2 begin rc left
  shift 2
  left=$((deadline - $(date +%s) - margin))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    say "== $name: SKIPPED (${left} s left of the ${budget} s budget)"
    status=1
    return 124
  fi
  begin=$(date +%s)
  timeout -k 5 "$limit" "$@"
  rc=$?
  say "== $name: exit $rc after $(($(date +%s) - begin)) s (limit ${limit} s)"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

# The GPU gate: without a visible GPU the Triton tests would run in the interpreter and the CUDA ones skip.
dry=${GPU_CHECK_DRY_RUN:-}
device=cuda
[ -n "$dry" ] && device=cpu
if [ -z "$dry" ] && ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  say "gpu_check: torch sees no GPU (torch.cuda.is_available() is False): nothing to check here"
  exit 3
fi
{
  date -u
  [ -n "$dry" ] && echo "gpu_check: dry run (GPU_CHECK_DRY_RUN): each step's CPU stand-in"
  [ -n "$dry" ] || nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'triton', triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU', \
'code', '${FGFW_CODE:-unknown}')"
  command -v nvcc >/dev/null && nvcc --version | tail -1
} 2>&1 | tee -a "$summary"

# The build, for sm_90 only, into .gpu/ (git-ignored, so a second command on the same machine finds it);
# rebuilt when the sources' hash differs from the one it was built from.
root=$PWD
site=$root/.gpu/site
stamp=$(cat CMakeLists.txt pyproject.toml $(find csrc python -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' \
  -o -name '*.cpp' -o -name '*.py' -o -name '*.in' \) | sort) | sha1sum | cut -c1-16)
built=0
if [ -n "$dry" ]; then
  say "== build: dry run, the installed fgfw ($(python3 -c 'import fgfw; print(fgfw.__file__)'))"
  built=1
elif [ -f "$root/.gpu/stamp" ] && [ "$(cat "$root/.gpu/stamp")" = "$stamp" ]; then
  say "== build: reusing .gpu/site (sources unchanged, hash $stamp)"
  built=1
else
  rm -rf "$root/.gpu"
  mkdir -p "$root/.gpu"
  if run build 170 env TORCH_CUDA_ARCH_LIST=9.0 FGFW_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
      python3 -m pip install -v --no-build-isolation --no-deps --upgrade --target "$site" \
      -C build-dir="$root/.gpu/build" . >"$out/build.log" 2>&1; then
    echo "$stamp" >"$root/.gpu/stamp"
    built=1
  else
    tail -25 "$out/build.log" | tee -a "$summary"
  fi
fi
if [ "$built" -eq 1 ] && [ -z "$dry" ]; then
  export PYTHONPATH=$site
  python3 -c "import fgfw, torch; print('fgfw from', fgfw.__file__); \
assert torch._C._dispatch_has_kernel_for_dispatch_key('fgfw::l1_fw_step_', 'CUDA'), 'no CUDA kernels'" \
    2>&1 | tee -a "$summary" || built=0
fi
if [ "$built" -eq 0 ]; then
  # the sources without fgfw._C: the Triton and reference backends still run
  export PYTHONPATH=$root/python
  say "gpu_check: WARNING: no CUDA build; going on with the Triton backend only"
fi

if [ "$phase" = key ]; then
  bench=(python3 bench/kernel_bench.py --device "$device" --min-time 0.2 --warmup 3)
  sizes=(1e6 1e8)
  backends=copy,eager,fused,triton,compile
  extra=(--mlp-rows --more-tangents 4)
  if [ -n "$dry" ]; then
    bench=(python3 bench/kernel_bench.py --device cpu --min-time 0 --warmup 1)
    sizes=(1e4)
    backends=copy,eager,fused
    extra=(--model-width 0)
  fi
  # issue 29's whole-step rows first (GPT-2 small and one 1e8 tensor, fgfw against AdamW and Muon)
  step_bench=(python3 bench/optimizer_step.py --device cuda --preset gpt2 --warmup 2 --repeats 7)
  [ -n "$dry" ] && step_bench=(python3 bench/optimizer_step.py --device cpu --preset quick --warmup 1 --repeats 2)
  python3 -c "import transformers" 2>/dev/null || step_bench+=(--methods)  # without it: the one-tensor rows only
  run "optimizer step benchmark" 90 "${step_bench[@]}" --out "$out/optimizer_step_gpu.csv" \
    >"$out/optimizer_step_gpu.log" 2>&1
  grep -E "^(\||[a-z_0-9]+:)|Error" "$out/optimizer_step_gpu.log" | tee -a "$summary"
  # issue 30: where one lean forward-gradient step spends host and device time
  profile=(python3 scripts/profile_lean_step.py --device cuda)
  [ -n "$dry" ] && profile=(python3 scripts/profile_lean_step.py --device cpu --tiny)
  if python3 -c "import transformers" 2>/dev/null; then
    run "lean step profile" 60 "${profile[@]}" --out "$out/lean_profile.txt" >"$out/lean_profile.log" 2>&1
    grep -E "^(wall|lean AFGFW)" "$out/lean_profile.txt" 2>/dev/null | tee -a "$summary"
    # issue 30, item 2: the same with TF32 products (is the SIMT sgemm float32's own path?); a CUDA setting, so
    # the dry run (CPU) leaves it out and keeps its time for the rest of the phase
    if [ -z "$dry" ]; then
      run "lean step profile, TF32" 60 "${profile[@]}" --tf32 --out "$out/lean_profile_tf32.txt" \
        >"$out/lean_profile_tf32.log" 2>&1
      grep -E "^(wall|lean AFGFW)" "$out/lean_profile_tf32.txt" 2>/dev/null | tee -a "$summary"
    fi
  else
    say "== lean step profile: not run (no transformers)"
  fi
  # issue 30, item 3: attention's primal and tangent, the fused Triton kernel against the chunked rule and the
  # SDPA forward (GPT-2 small's 8 x 12 heads, sequence 512 and 2048, float32 and bfloat16)
  attention=(python3 bench/attention_jvp.py --device cuda)
  [ -n "$dry" ] && attention=(python3 bench/attention_jvp.py --device cpu --tiny)
  run "attention JVP benchmark" 45 "${attention[@]}" --out "$out/attention_jvp_gpu.csv" \
    >"$out/attention_jvp_gpu.log" 2>&1
  grep -E "^(\||target:)|Error" "$out/attention_jvp_gpu.log" | tee -a "$summary"
  mkdir -p "$root/.gpu"
  if command -v nvcc >/dev/null && run "gaussian_roof build" 40 nvcc -O3 -std=c++17 -arch=sm_90 -I csrc \
      bench/gaussian_roof.cu -o "$root/.gpu/gaussian_roof" >"$out/gaussian_roof.txt" 2>&1 && [ -z "$dry" ]; then
    for k in 1 4; do
      run "gaussian_roof K=$k" 30 "$root/.gpu/gaussian_roof" 1e8 "$k" >>"$out/gaussian_roof.txt" 2>&1
    done
  fi
  left=$((deadline - $(date +%s) - margin - 15))
  run "kernel benchmark" 400 "${bench[@]}" --sizes "${sizes[@]}" --modes afgfw fgfw fw "${extra[@]}" \
    --backends "$backends" --compile-sizes 1e8 --compile-modes afgfw --deadline "$left" \
    --out "$out/kernel_gpu.csv" --figure "$out/kernel_gpu.png" >"$out/kernel_gpu.log" 2>&1
  grep -E "^(FAILED|WARNING|DEADLINE)" "$out/kernel_gpu.log" | tee -a "$summary"
  grep -E "^\|" "$out/gaussian_roof.txt" | tee -a "$summary"
  grep -E "^\|" "$out/kernel_gpu.log" | tee -a "$summary"
elif [ "$phase" = models ]; then
  # issue 30: GPT-2 small, float32, batch 8 x 512 and 2 x 2048: inference, backprop + AdamW(fused), MeZO, lean
  # AFGFW K = 1 and K = 4, the activity estimator with recompute_inputs; time and peak memory, each case a process
  models=(python3 bench/real_models.py --preset gpt2 --device cuda --rounds 1 --repeats 3 --methods
    forward,backprop_adamw,mezo,afgfw_lean,afgfw_lean_k4,afgfw_activity_recompute --case-timeout 120)
  [ -n "$dry" ] && models=(python3 bench/real_models.py --preset tiny --device cpu --models gpt2 --rounds 1 \
    --repeats 1 --methods forward,backprop_adamw,afgfw_lean)
  # issue 31, item 4: GPT-2 small pre-trained here (300 Adam steps), then fine-tuned by each method for 200 forward
  # passes (each capped at 30 s of steps), float32, batch 8 x 512; the CSV is rewritten after every method
  finetune=(python3 bench/finetune.py --task text --model gpt2-small --device cuda)
  [ -n "$dry" ] && finetune=(python3 bench/finetune.py --task text --model gpt2-small --device cpu --quick)
  finetune_reserve=270
  if python3 -c "import transformers" 2>/dev/null; then
    run "real models (GPT-2)" $((deadline - $(date +%s) - margin - finetune_reserve)) "${models[@]}" \
      --name real_models_gpu --out "$out" --figures "$out" >"$out/real_models_gpu.log" 2>&1
    grep -E "^(gpt2|model )" "$out/real_models_gpu.log" | tee -a "$summary"
    run "fine-tuning GPT-2 small" "$finetune_reserve" "${finetune[@]}" --out "$out" >"$out/finetune_gpt2_small.log" 2>&1
    grep -E "^(\||gpt2-small)|Error" "$out/finetune_gpt2_small.log" | tee -a "$summary"
  else
    say "== real models and fine-tuning: not run (no transformers)"
  fi
else
  xdist=()
  python3 -c "import xdist" 2>/dev/null && xdist=(-n "${GPU_TEST_WORKERS:-16}" --dist load)
  per_test=()
  python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 60)
  # CUDA first (kernels, graphs, feasibility, properties), then Triton (each specialisation JIT-compiles), so
  # that a run cut short keeps the CUDA results; -v prints each result as it lands.
  for part in cuda triton; do
    # measured on an H200 (2026-11-27, 16 workers): the CUDA part 120 s (the 20,000-step feasibility trajectories
    # take 35-60 s each, so they carry a longer timeout marker), the Triton part 154 s from a cold JIT cache
    select="not triton"
    limit=150
    [ "$part" = triton ] && select="triton" && limit=175
    if [ -n "$dry" ]; then  # collected, not run: the GPU tests must still import and select
      run "tests ($part), collected" 120 python3 -m pytest --gpu-only -k "$select" --collect-only -q \
        -p no:cacheprovider tests >"$out/tests_$part.log" 2>&1
      grep -E "tests? collected|error" "$out/tests_$part.log" | tail -3 | tee -a "$summary"
      continue
    fi
    run "tests ($part)" "$limit" env FGFW_REQUIRE_EXTENSION="$built" FGFW_REQUIRE_CUDA_KERNELS="$built" \
      python3 -m pytest --gpu-only -k "$select" -v -rfEs "${xdist[@]}" "${per_test[@]}" -p no:cacheprovider \
      --durations 10 tests >"$out/tests_$part.log" 2>&1
    grep -E "^(FAILED|ERROR)|Timeout| passed| failed|no tests ran|fgfw backends" "$out/tests_$part.log" | tail -30 \
      | tee -a "$summary"
  done

  # compute-sanitizer refuses the device on some machines (gVisor): try it on a trivial program first
  : >"$out/sanitizer.log"
  if [ -n "$dry" ]; then  # the sanitizer's script on the CPU kernels
    run "gpu_sanitize.py on the CPU" 120 python3 scripts/gpu_sanitize.py --device cpu >>"$out/sanitizer.log" 2>&1
    tail -3 "$out/sanitizer.log" | tee -a "$summary"
  elif [ "$built" -eq 1 ] && command -v compute-sanitizer >/dev/null && \
      timeout 60 compute-sanitizer --tool memcheck --error-exitcode 99 python3 -c \
      "import torch; torch.ones(4, device='cuda').sum().item()" >>"$out/sanitizer.log" 2>&1; then
    for tool in memcheck racecheck; do
      run "compute-sanitizer $tool" 45 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool "$tool" \
        --error-exitcode 99 python3 scripts/gpu_sanitize.py >>"$out/sanitizer.log" 2>&1
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|gpu_sanitize" "$out/sanitizer.log" | tail -2 | tee -a "$summary"
    done
  else
    say "== compute-sanitizer: not run (absent, no CUDA build, or it refuses this machine's device: sanitizer.log)"
    tail -5 "$out/sanitizer.log" | tee -a "$summary"
  fi
  # if time is left: the memory headline (forward-gradient step against backprop, --quick), then the
  # torch.compile rows of FGFW and FW
  left=$((deadline - $(date +%s) - margin - 10))
  [ -n "$dry" ] && left=0 && say "== memory and compile rows: dry run, left out"
  if [ "$left" -gt 30 ]; then
    run "memory (quick)" "$left" python3 bench/memory.py --device cuda --quick --out "$out/memory_gpu.csv" \
      >"$out/extra.log" 2>&1
  fi
  left=$((deadline - $(date +%s) - margin - 10))
  [ -n "$dry" ] && left=0
  if [ "$left" -gt 40 ]; then
    run "compile rows" "$left" python3 bench/kernel_bench.py --device cuda --min-time 0.2 --sizes 1e8 \
      --modes fgfw fw --backends copy,eager,compile --model-width 0 --deadline $((left - 30)) \
      --out "$out/kernel_gpu_compile.csv" --figure none >>"$out/extra.log" 2>&1
    grep -E "^\|" "$out/extra.log" | tee -a "$summary"
  fi
fi
say "gpu_check $phase: exit $status after $(($(date +%s) - started)) s (budget $budget s)"
exit $status
