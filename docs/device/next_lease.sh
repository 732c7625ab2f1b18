#!/bin/bash
# The next lease's one call (the GPU program's kernels), prepared on the CPU. From the repository root:
#   echo /.dev/ >> .git/info/exclude; mkdir -p .dev; cp docs/device/next_lease.sh .dev/run.sh
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux2014_x86_64 -d .dev ml-collections==1.1.0 gguf==0.19.0
# leave the shipped heads' weights behind (the tree must stay under 64 MiB):
#   for f in mdjax/assets/*/heads.safetensors; do git rm -q --cached $f; echo /$f >> .git/info/exclude; done
# then run `bash .dev/run.sh` with `.dev` carried and a timeout of ~560 s, give the machine
# back, and restore the index (`git reset -q HEAD -- mdjax/assets`, the exclude lines removed).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
LOG=$OUT/run.log
{ date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import jax, transformers; print('jax', jax.__version__, jax.devices(), 'transformers', transformers.__version__)"; } > $LOG 2>&1
# 1. The five files the last lease cut before pytest's summary, each its own pytest, all at
#    once (3 workers each), on the GPU (JAX_PLATFORMS empty); and the GPU-built passes run
#    there (the attention and normed-product kernels for real, against the CPU-built pass).
T0=$(date +%s)
for f in eagle3 branches generate accelerator eagle gpu_kernels gpu_int8_cache quantized; do
  pick=(); [ $f = gpu_kernels ] && pick=(-k "built_for_a_gpu or eagle3")
  [ $f = gpu_int8_cache ] && pick=(-k "built_for_a_gpu")
  [ $f = quantized ] && pick=(-k "built_for_a_gpu")
  ( JAX_PLATFORMS= timeout 240 python3 -m pytest -q -o addopts= -p no:cacheprovider -rfE -n 3 -m "not real_models" ${pick[@]+"${pick[@]}"} tests/test_$f.py > /tmp/t_$f.log 2>&1; echo "rc=$? file=$f seconds=$(( $(date +%s) - T0 ))" >> /tmp/t_$f.log ) &
done
wait
for f in /tmp/t_*.log; do echo "######## $f"; cat $f; done > $OUT/tests.log
grep -h "rc=\| passed\| failed" /tmp/t_*.log | grep -v "^E " >> $LOG
# 2. One greedy step kernel by kernel (where the 52% under the roofline goes), the pass
#    cost as `auto` measures it (batches 1 and 8), and the roofline again.
timeout 200 python3 -m experiments.device_check --sections=profile,pass_cost,roofline --batches=1,8 --out_dir=$OUT >> $LOG 2>&1; echo "device_check rc=$?" >> $LOG
# 2b. The roofline with XLA's own products and fusions (nine kernels a layer where mdjax's
#     make five: `mdjax.models.decode_products`; batch 8 runs its residual products), to
#     weigh them.
MDJAX_PALLAS_PRODUCTS=0 timeout 100 python3 -m experiments.device_check --sections=roofline --batches=1,8 --out_dir=$OUT/xla_products >> $LOG 2>&1; echo "device_check xla_products rc=$?" >> $LOG
# 2c. Greedy on the 1B shape with bfloat16, int8 and int4 weights and an int8 cache at an
#     8k context, batches 1 and 8: ms per token (the kernels' first timing).
timeout 150 python3 - >> $LOG 2>&1 <<'PY'
import json, os, time
import mdjax
rows = []
for quantize, kv in [(None, None), ("int8", None), ("int4", None), (None, "int8"), ("int8", "int8")]:
  model = mdjax.load("random-llama-1b", quantize=quantize)
  for batch in (1, 8):
    prompts = [[3 + i] * 8000 for i in range(batch)]
    run = lambda n: mdjax.generate(model, prompts, max_new_tokens=n, eos_token_id=[],
                                   kv_cache_dtype=kv).stats["wall_s"]
    run(33); run(1)
    ms = min((run(33) - run(1)) / 32 for _ in range(3)) * 1e3
    rows.append(dict(quantize=quantize, kv=kv, batch=batch, ms_per_token=ms))
    print(rows[-1], flush=True)
json.dump(rows, open(os.path.join(os.environ["OUT"], "quantized_timing.json"), "w"), indent=1)
PY
echo "quantized timing rc=$?" >> $LOG
# 3. MultiDecode's own table in float32, the reference's two points only.
timeout 120 python3 -m experiments.bench.reproduce_multidecode --model=random-llama-1b --ns=100 --new_tokens=2 --baselines=sequential --sequential_questions=4 --repeats=2 --out_dir=$OUT >> $LOG 2>&1; echo "multidecode rc=$?" >> $LOG
date >> $LOG
tail -c 9000 $LOG
