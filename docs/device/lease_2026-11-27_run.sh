#!/bin/bash
# One lease: issue 49's device items. Everything lands in $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
LOG=$OUT/run.log
{ date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import jax, transformers; print('jax', jax.__version__, jax.devices(), 'transformers', transformers.__version__)"; } > $LOG 2>&1
echo "== 1. the seven files + accelerator tests on the GPU, each its own pytest" >> $LOG
T0=$(date +%s)
for f in gguf eagle3 beam eagle branches head_formats generate accelerator; do
  w=2; [ $f = gguf ] && w=3
  ( JAX_PLATFORMS= timeout 165 python3 -m pytest -q -o addopts= -p no:cacheprovider -rfE -n $w -m "not real_models" tests/test_$f.py > /tmp/t_$f.log 2>&1; echo "rc=$? file=$f seconds=$(( $(date +%s) - T0 ))" >> /tmp/t_$f.log ) &
done
wait
for f in /tmp/t_*.log; do echo "######## $f"; cat $f; done > $OUT/tests.log
grep -h "rc=\| passed\| failed\|error" /tmp/t_*.log | grep -v "^E " | tail -40 >> $LOG
echo "== 2. device_check roofline, pass_cost $(date)" >> $LOG
timeout 190 python3 -m experiments.device_check --sections=roofline,pass_cost --pass_ns=1,2,4,8,16,32,64 --out_dir=$OUT >> $LOG 2>&1; echo "device_check rc=$?" >> $LOG
echo "== 3. reproduce_multidecode, random 1B $(date)" >> $LOG
timeout 150 python3 -m experiments.bench.reproduce_multidecode --model=random-llama-1b --ns=8,32,100 --new_tokens=2,199 --baselines=sequential,batching --sequential_questions=4 --skip_above_s=10 --repeats=2 --out_dir=$OUT >> $LOG 2>&1; echo "multidecode rc=$?" >> $LOG
date >> $LOG
tail -c 9000 $LOG
