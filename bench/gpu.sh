#!/usr/bin/env bash
# On the accelerator machine (no network): install the wheels carried in .whl/, run the GPU tests,
# then the engine throughput table. Writes JSON and logs to $OUT (or ./bench-out).
set -euo pipefail
out=${OUT:-bench-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/workers/engine/test_cuda.py tests/workers/engine/test_sampler.py 2>&1 | tail -5
python3 -m bench.engine_throughput --device cuda --random-weights --batch-sizes "${BATCH_SIZES:-1,16,64,256}" \
  --prompt-len 512 --new-tokens 128 --max-batched-tokens 32768 >"$out/engine_throughput_gpu.json" 2>"$out/engine_throughput_gpu.log"
python3 -c "
import json; d = json.load(open('$out/engine_throughput_gpu.json'))
print('batch engine prefill_tok_s decode_tok_s')
for r in d['rows']: print(r['batch_size'], r['engine'], r['prefill_tok_s'], r['decode_tok_s'])
print(json.dumps(d['ratios']))"
