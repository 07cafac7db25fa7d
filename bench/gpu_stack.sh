#!/usr/bin/env bash
# The whole served stack on the accelerator machine (no network): installs the wheels carried in .whl/,
# makes a model directory of a Llama-3.1-8B shape (random bf16 weights drawn from the seed in every
# process, SmolLM2's tokenizer, carried in .gpu/tokenizer/), and runs bench.gpu_stack: `serve --device
# cuda` driven by bench.serve against the offline engine on the same requests. Writes JSON and the
# bench.serve reports to $OUT (or ./bench-out).
#
# Wheels to carry in .whl/ (the image lacks them; see the device tool's README for how), for Python
# 3.12 manylinux x86_64, without their dependencies the image has (numpy, jinja2, click, requests, ...):
#   django==5.2.19 djangorestframework==3.18.3 channels==4.3.2 celery==5.7.0 redis==8.1.0
#   deepseek-recipe==0.2.0 llguidance==1.9.1 uvicorn==0.54.0 drf-spectacular==0.30.0 django-filter==26.2
#   django-plotly-dash==2.5.1 dpd-components==0.2.0 (built from its sdist) dash==3.4.0 plotly==7.1.0
#   websockets==17.4 msgspec==0.23.0 pyzmq==27.3.0 gguf==0.19.0, and what they pull in: asgiref sqlparse
#   kombu amqp vine billiard click-didyoumean click-plugins click-repl prompt-toolkit wcwidth tzlocal
#   uritemplate inflection jsonschema jsonschema-specifications referencing rpds-py flask itsdangerous
#   blinker retrying nest-asyncio lazy-importer importlib-metadata (about 46 MB). The tokenizer: .gpu/tokenizer/ holds
#   tokenizer.json and tokenizer_config.json of the packaged SmolLM2 (~/.cache/sluice/models/...).
# STEPS (default "serving,acceptance,cached,equal") picks what bench.gpu_stack runs; BENCH_ARGS adds options.
set -euo pipefail
out=${OUT:-bench-out}
steps=${STEPS:-serving,acceptance,cached,equal}
mkdir -p "$out"
for wheel in django msgspec pyzmq deepseek_recipe; do
  ls .whl/"$wheel"-*.whl >/dev/null 2>&1 || { echo "missing .whl/$wheel-*.whl (see the top of bench/gpu_stack.sh)"; exit 2; }
done
[ -f .gpu/tokenizer/tokenizer.json ] || { echo "missing .gpu/tokenizer/tokenizer.json (see the top of bench/gpu_stack.sh)"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
model=/tmp/llama-3.1-8b-shape
mkdir -p "$model"
cp .gpu/tokenizer/tokenizer.json .gpu/tokenizer/tokenizer_config.json "$model"/
python3 - "$model" <<'EOF'
import json, sys
# Llama-3.1-8B's layers; SmolLM2's vocabulary, so that its tokenizer reads every id the model writes.
config = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
json.dump(config, open(f"{sys.argv[1]}/config.json", "w"))
EOF
python3 -m bench.gpu_stack --model-dir "$model" --out "$out" --steps "$steps" ${BENCH_ARGS:-} 2>&1 | tee "$out/gpu_stack.log"
