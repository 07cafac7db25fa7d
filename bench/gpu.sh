#!/usr/bin/env bash
# On the accelerator machine (no network): install the wheels carried in .whl/, run the GPU tests,
# profile a decode step, then the engine throughput table. Writes JSON and logs to $OUT (or ./bench-out).
#
# Wheels to carry in .whl/ (the machine's image lacks them; see the device tool's README for how):
#   msgspec==0.23.0 (cp312 manylinux), gguf==0.19.0 (py3-none-any)
# Everything else the engine and the benchmark import (torch, triton, numpy, safetensors,
# tokenizers, jinja2, tqdm, pyyaml, transformers) is in the image.
set -euo pipefail
out=${OUT:-bench-out}
mkdir -p "$out"
for wheel in msgspec gguf; do
  ls .whl/"$wheel"-*.whl >/dev/null 2>&1 || { echo "missing .whl/$wheel-*.whl (see the top of bench/gpu.sh)"; exit 2; }
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/workers/engine tests/kernels 2>&1 | tee "$out/gpu_tests.log" | tail -25
for batch in 1 64; do
  python3 -m bench.profile_step --device cuda --batch-size "$batch" --steps 5 >"$out/profile_b$batch.txt" 2>&1 || true
  head -8 "$out/profile_b$batch.txt"
done
python3 -m bench.engine_throughput --device cuda --random-weights --batch-sizes "${BATCH_SIZES:-1,16,64,256}" \
  --prompt-len 512 --new-tokens 128 --max-batched-tokens 131072 >"$out/engine_throughput_h200.json" 2>"$out/engine_throughput_gpu.log"
python3 -c "
import json; d = json.load(open('$out/engine_throughput_h200.json'))
print('batch engine prefill_tok_s decode_tok_s decode_hbm_fraction')
for r in d['rows']: print(r['batch_size'], r['engine'], r['prefill_tok_s'], r['decode_tok_s'], r['decode_hbm_fraction'])
print(json.dumps(d['ratios']))"
