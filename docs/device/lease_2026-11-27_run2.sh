#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
LOG=$OUT/run2.log
for fl in "--xla_cpu_use_fusion_emitters=false" "--xla_backend_optimization_level=0"; do
  echo "== XLA_FLAGS=$fl" >> $LOG; XLA_FLAGS=$fl timeout 60 python3 -c "import jax; print(jax.devices(), jax.numpy.ones(3).sum())" >> $LOG 2>&1; echo "rc=$?" >> $LOG
done
T0=$(date +%s)
for f in gguf eagle3 beam eagle branches head_formats generate accelerator; do
  w=2; [ $f = gguf ] && w=3
  ( JAX_PLATFORMS= timeout 175 python3 -m pytest -q -o addopts= -p no:cacheprovider -rfE -n $w -m "not real_models" tests/test_$f.py > /tmp/t_$f.log 2>&1; echo "rc=$? file=$f seconds=$(( $(date +%s) - T0 ))" >> /tmp/t_$f.log ) &
done
wait
for f in /tmp/t_*.log; do echo "######## $f"; cat $f; done > $OUT/tests2.log
grep -h "rc=\| passed\| failed" /tmp/t_*.log | grep -v "^E " | tail -40 >> $LOG
tail -c 6000 $LOG
