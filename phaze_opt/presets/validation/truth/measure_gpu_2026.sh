#!/usr/bin/env bash
# The device run behind truth/h200-blocks-2026.json: `phaze-opt measure` on one GPU for the 2024-26
# model blocks (GQA + SwiGLU + RoPE, MoE, MLA), eager and compiled (TorchInductor), CUDA events without
# graph replay as the shipped H100 truth was timed. Each step has its own time limit and the merged
# file is rewritten after every step, so a run cut short still returns what it measured.
# Usage: OUT=folder bash measure_gpu_2026.sh   (python3 must hold a CUDA PyTorch, PyYAML and NumPy)
set -u
OUT=${OUT:-out}; mkdir -p "$OUT/parts"
export PHAZE_OPT_CACHE=/tmp/phaze-cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
step() {  # step NAME LIMIT_S ARGS...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  # measure's own parser and run, without the CLI that loads every command (the solvers need PuLP)
  timeout "$limit" python3 -c 'import argparse, sys
from phaze_opt.commands import measure as m
p = argparse.ArgumentParser(); m.add_arguments(p); print(m.render(m.run(p.parse_args(sys.argv[1:]))))' --device cuda --no-cuda-graphs --repeats 10 --warmup 3 \
    --out "$OUT/parts/$name.json" "$@" 2>&1 | grep -v "still working"
  echo "[step $name: rc ${PIPESTATUS[0]}, $((SECONDS - t0)) s]"
  python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1]); merged = None
for part in sorted((out / "parts").glob("*.json")):
    d = json.loads(part.read_text())
    if merged is None:
        merged = {**d, "layers": [], "gemm": [], "skipped": []}
    merged["layers"] += d["layers"]; merged["gemm"] += d["gemm"]; merged["skipped"] += d.get("skipped", [])
if merged:
    (out / "blocks.json").write_text(json.dumps(merged, indent=1) + "\n")
PY
}
step a-gpt3 60 --model gpt3-175b --tp 8 --mbs 1 --attention unfused flash
step b-llama2 60 --model llama2-70b --tp 8 --mbs 1 --attention unfused flash
step c-llama3-8b 70 --model llama3-8b --tp 1 2 4 8 --mbs 1 --gemms
step d-llama3-70b 60 --model llama3-70b --tp 4 8 --mbs 1
step e-llama3-405b 60 --model llama3-405b --tp 8 --mbs 1
step f-qwen3-30b 60 --model qwen3-30b-a3b --tp 1 2 4 --mbs 1
step g-mixtral 60 --model mixtral-8x7b --tp 2 4 8 --mbs 1
step h-deepseek-v3 60 --model deepseek-v3 --tp 8 --mbs 1
step i-ind-llama3-8b 90 --model llama3-8b --tp 1 --mbs 1 --kernels inductor
step j-ind-gpt3 90 --model gpt3-175b --tp 8 --mbs 1 --attention unfused --kernels inductor
step k-ind-llama3-70b 90 --model llama3-70b --tp 8 --mbs 1 --kernels inductor
step l-ind-qwen3 90 --model qwen3-30b-a3b --tp 1 --mbs 1 --kernels inductor
echo "[total $SECONDS s]"
