#!/usr/bin/env bash
# The long GPU benchmarks, for when a lease has time beyond scripts/gpu_check.sh (which builds the
# extension; run it first, in the same command, or set PYTHONPATH to an fgfw built for this GPU):
# the kernel benchmark at every size (1e4 .. 1e9 as memory allows), the training step, memory and
# activity-estimator benchmarks, the real models of issue 23 (bench/real_models.py --preset gpu), and issue 24's
# optimizer-step and language-model benchmarks. Results go to ${OUT:-results/gpu}.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0
timeout -k 10 600 python3 bench/kernel_bench.py --device cuda --backends fused,triton,eager,compile,copy \
  --modes afgfw fgfw fw --mlp-rows --compile-sizes 1e6 1e8 \
  --out "$out/kernel_gpu_full.csv" --figure "$out/kernel_gpu_full.png" >"$out/kernel_gpu_full.log" 2>&1 || status=1
timeout -k 10 600 python3 bench/train_step.py --device cuda --out "$out/train_step" >"$out/train_step_gpu.log" 2>&1 \
  || status=1
timeout -k 10 600 python3 bench/memory.py --device cuda --out "$out/memory_gpu.csv" >"$out/memory_gpu.log" 2>&1 \
  || status=1
timeout -k 10 600 python3 bench/activity.py --device cuda --out "$out/activity_gpu.csv" >"$out/activity_gpu.log" 2>&1 \
  || status=1
# issue 23: every method's step on a GPT-2-small-like and a ~1 B LLaMA-like model in bfloat16 (needs transformers);
# one command per model, each case a fresh process (the 1 B model's ten cases take minutes)
for model in gpt2_124m llama_1b; do
  timeout -k 10 600 python3 bench/real_models.py --preset gpu --device cuda --models "$model" --rounds 1 --repeats 5 \
    --name "real_models_$model" --out "$out" --figures "$out" >"$out/real_models_$model.log" 2>&1 || status=1
done
# issue 24: one optimizer step of FrankWolfe on Scion's sets against AdamW and Muon on a GPT-2 124M-like model,
# then the language-model benchmark's GPU preset (3 seeds x 4 methods: the longest; its own timeout)
timeout -k 10 300 python3 bench/optimizer_step.py --device cuda --preset gpt2 --out "$out/optimizer_step_gpu.csv" \
  >"$out/optimizer_step_gpu.log" 2>&1 || status=1
timeout -k 10 3600 python3 bench/lm.py --device cuda --preset gpu --out "$out/lm_gpu.csv" --figure "$out/lm_gpu.png" \
  >"$out/lm_gpu.log" 2>&1 || status=1
exit $status
