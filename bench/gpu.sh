#!/usr/bin/env bash
# On the accelerator machine (no network): install the wheels carried in .whl/, run the GPU tests,
# time decode attention per keys-per-split and the fused MoE layer against the per-expert loop, the
# EP layer's dispatch and combine (one rank, NCCL) against the plain fused op, a KV handoff between
# two processes on the GPU through the workers' transfer backends (frames through host memory vs CUDA
# IPC), a cached long prompt's first token (where its time goes), the regression test of the
# device path's staging race under compute-sanitizer (memcheck and racecheck), profile decode steps,
# the engine throughput table against HF, and fit the cost model (prefill and decode steps). Writes
# JSON and logs to $OUT (or ./bench-out).
#
# Wheels to carry in .whl/ (the machine's image lacks them; see the device tool's README for how):
#   msgspec==0.23.0 (cp312 manylinux), gguf==0.19.0 (py3-none-any), pyzmq==27.3.0 (cp312 abi3 manylinux)
# Everything else the engine and the benchmark import (torch, triton, numpy, safetensors,
# tokenizers, jinja2, tqdm, pyyaml, transformers) is in the image.
# The served stack has a script of its own, bench/gpu_stack.sh (its wheels include these).
# Then the MLA decode kernel alone (DeepSeek-V3's 128 heads) against the copy bandwidth, MLA prefill's
# absorbed form against its decompressed form per chunk and cached prefix (DeepSeek-V2-Lite's 16 heads
# and V3's 128), and decode of the shapes in bench.shapes (Llama-3.1-8B, Qwen3-30B-A3B's 16 layers,
# DeepSeek-V2-Lite) as fractions of their memory rooflines, and a profile of a MoE shape's graphed
# decode step at batch 1.
# Then FP8 (issue 26): the W8A8 block-scaled GEMM against bf16 and torch's _scaled_mm at the Llama-3.1-8B
# projections, decode attention alone over FP8 and bf16 rows (bench.kv_decode_attention), and decode with
# FP8 weights and KV against bf16 (Llama-3.1-8B at batch 1 and at batch
# 256 with 4k contexts; DeepSeek-V3's 4-layer shape at batch 1 and 64 against its roofline).
# STEPS (default "tests attention mla mla_prefill moe ep handoff cached sanitizer profile roofline throughput fit
# fp8_gemm fp8_decode")
# picks what runs; "mla_sweep" (not a default: it compiles about 70 kernels, several minutes) times the
# MLA decode kernel's configs at DeepSeek-V3's 128 heads and V2-Lite's 16.
set -euo pipefail
out=${OUT:-bench-out}
steps=${STEPS:-tests attention mla mla_prefill moe ep handoff cached sanitizer profile roofline throughput fit fp8_gemm fp8_decode vision_encoder}
mkdir -p "$out"
for wheel in msgspec gguf pyzmq; do
  ls .whl/"$wheel"-*.whl >/dev/null 2>&1 || { echo "missing .whl/$wheel-*.whl (see the top of bench/gpu.sh)"; exit 2; }
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import json; from bench.smollm2_config import SMOLLM2_135M_CONFIG as c; json.dump(c, open('/tmp/smollm2.json', 'w'))"
has() { [[ " $steps " == *" $1 "* ]]; }
if has tests; then
  # The KV sizing tests measure their process's device memory outside torch: they run in a process of
  # their own, before other tests' NCCL groups and compiled kernels add to it.
  sizing=tests/workers/engine/sizing/test_kv_sizing_cuda.py
  { python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu "$sizing"; sized=$?
    python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/workers/engine --deselect "$sizing" \
      tests/workers/worker/test_serving_on_cuda.py tests/kernels && [ "$sized" -eq 0 ]; } 2>&1 | tee "$out/gpu_tests.log" | tail -40 \
    || echo "GPU TESTS FAILED (the benchmarks still run)"
fi
if has attention; then
  python3 -m bench.decode_attention | tee "$out/decode_attention_h200.json"
fi
if has mla; then
  python3 -m bench.mla_decode | tee "$out/mla_decode_gpu.json" || echo "MLA DECODE BENCHMARK FAILED"
fi
if has mla_sweep; then
  python3 -m bench.mla_decode --sweep >"$out/mla_sweep_128_heads.json" 2>"$out/mla_sweep_128_heads.log" \
    || echo "MLA DECODE SWEEP FAILED (128 heads)"
  python3 -m bench.mla_decode --sweep --heads 16 --batch-sizes 1,16,64,256 >"$out/mla_sweep_16_heads.json" \
    2>"$out/mla_sweep_16_heads.log" || echo "MLA DECODE SWEEP FAILED (16 heads)"
fi
if has mla_prefill; then
  python3 -m bench.mla_prefill_forms | tee "$out/mla_prefill_forms_gpu.json" || echo "MLA PREFILL FORMS BENCHMARK FAILED"
fi
if has moe; then
  python3 -m bench.moe_layer | tee "$out/moe_layer_h200.json"
fi
if has ep; then
  python3 -m bench.ep_layer | tee "$out/ep_layer_h200.json"
fi
if has handoff; then
  python3 -m bench.kv_handoff --shapes smollm2_135m,llama3_8b,deepseek_v2_lite | tee "$out/kv_handoff_gpu.json" || echo "KV HANDOFF BENCHMARK FAILED"
fi
if has cached; then
  python3 -m bench.cached_prefill | tee "$out/cached_prefill_gpu.json" || echo "CACHED PREFILL BENCHMARK FAILED"
fi
if has sanitizer; then
  race=tests/workers/engine/test_cuda.py::test_a_long_prompt_prepared_ahead_of_a_busy_device_keeps_its_inputs
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --target-processes all python3 -m pytest -q -p no:cacheprovider -o addopts="" \
      "$race" >"$out/sanitizer_$tool.log" 2>&1 || echo "compute-sanitizer $tool: exit $?"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$out/sanitizer_$tool.log" | tail -3
  done
fi
if has profile; then
  for batch in 1 64 256; do
    python3 -m bench.profile_step --device cuda --batch-size "$batch" --steps 5 >"$out/profile_b$batch.txt" 2>&1 || true
    head -8 "$out/profile_b$batch.txt"
  done
  for moe_shape in qwen3_30b_a3b_16_layers deepseek_v2_lite; do
    python3 -m bench.profile_step --device cuda --shape "$moe_shape" --batch-size 1 --steps 5 \
      >"$out/profile_${moe_shape}_b1.txt" 2>&1 || true
    head -30 "$out/profile_${moe_shape}_b1.txt"
  done
fi
if has roofline; then
  python3 -m bench.decode_roofline --batch-sizes "${BATCH_SIZES:-1,16,64,256}" >"$out/decode_roofline_gpu.json" \
    2>"$out/decode_roofline_gpu.log" || echo "DECODE ROOFLINE BENCHMARK FAILED"
  python3 -c "
import json; d = json.load(open('$out/decode_roofline_gpu.json'))
print('shape batch decode_tok_s step_ms roofline_step_ms roofline_fraction')
for s in d['shapes']:
    for r in s['rows']: print(s['shape'], r['batch_size'], r['decode_tok_s'], r['step_ms'], r['roofline_step_ms'], r['roofline_fraction'])"
fi
if has throughput; then
  python3 -m bench.engine_throughput --device cuda --random-weights --batch-sizes "${BATCH_SIZES:-1,16,64,256}" \
    --prompt-len 512 --new-tokens 128 --max-batched-tokens 131072 >"$out/engine_throughput_h200.json" 2>"$out/engine_throughput_gpu.log"
  python3 -c "
import json; d = json.load(open('$out/engine_throughput_h200.json'))
print('batch engine prefill_tok_s decode_tok_s decode_hbm_fraction')
for r in d['rows']: print(r['batch_size'], r['engine'], r['prefill_tok_s'], r['decode_tok_s'], r['decode_hbm_fraction'])
print(json.dumps(d['ratios']))"
fi
if has fit; then
  python3 -m bench.fit_cost_model --model /tmp/smollm2.json --device cuda --trials 3 --decode \
    --out "$out/cost_model_h200.json" >"$out/fit_cost_model_h200.json" 2>"$out/fit_cost_model.log"
  python3 -c "
import json; d = json.load(open('$out/fit_cost_model_h200.json'))
print('prefill', d['coefficients'], d['fit_error_held_back'])
print('decode', d['decode']['coefficients'], d['decode']['fit_error_held_back'])"
fi
if has fp8_gemm; then
  python3 -m bench.fp8_gemm >"$out/fp8_gemm_gpu.json" 2>"$out/fp8_gemm_gpu.log" || echo "FP8 GEMM BENCHMARK FAILED"
fi
if has fp8_decode; then
  python3 -m bench.kv_decode_attention --batch-sizes 1,64,128 >"$out/kv_decode_attention.json" \
    2>"$out/kv_decode_attention.log" || echo "FP8 KV DECODE ATTENTION BENCHMARK FAILED"
  python3 -m bench.fp8_decode --shape llama3_8b --batch-sizes 1 --prompt-len 1024 --variants bf16,fp8_weights,fp8_kv \
    >"$out/fp8_decode_llama3_8b_b1.json" 2>"$out/fp8_decode.log" || echo "FP8 DECODE (batch 1) FAILED"
  python3 -m bench.fp8_decode --shape llama3_8b --batch-sizes 256 --prompt-len 4096 --new-tokens 64 \
    --variants bf16,fp8_weights_kv >"$out/fp8_decode_llama3_8b_b256.json" 2>>"$out/fp8_decode.log" \
    || echo "FP8 DECODE (batch 256) FAILED"
  python3 -m bench.fp8_decode --shape deepseek_v3_4_layers --batch-sizes 1,64 --variants fp8_weights \
    >"$out/fp8_decode_deepseek_v3_4_layers.json" 2>>"$out/fp8_decode.log" || echo "FP8 DECODE (DeepSeek-V3) FAILED"
  python3 -c "
import json
for name in ('llama3_8b_b1', 'llama3_8b_b256', 'deepseek_v3_4_layers'):
    d = json.load(open('$out/fp8_decode_' + name + '.json'))
    print(name, json.dumps(d['decode_speedup_over_bf16']))
    for variant, v in d['variants'].items():
        for r in v['rows']: print(' ', variant, r['batch_size'], r['max_running'], r['decode_tok_s'], r['roofline_fraction'])"
fi
if has vision_encoder; then
  python3 -m bench.vision_encoder --device cuda --shape so400m >"$out/vision_encoder_gpu.json" \
    2>"$out/vision_encoder_gpu.log" || echo "VISION ENCODER BENCHMARK FAILED"
  python3 -c "
import json; d = json.load(open('$out/vision_encoder_gpu.json'))
print('agreement', json.dumps(d['agreement']))
print('tiles patches ours_tower_patches_s hf_tower_patches_s ours_encoder_patches_s tower_speedup_over_hf')
for r in d['rows']:
    print(r['batch_tiles'], r['patches'], r['ours_tower_patches_per_s'], r['hf_tower_patches_per_s'],
          r['ours_encoder_patches_per_s'], r['tower_speedup_over_hf'])"
fi
