"""Python's cyclic collector in a test process: it walks less once the imports are done."""

import gc

from experiments import GC_THRESHOLDS  # the experiments' jobs run at the same

# Tracing and lowering make many short-lived Python objects, so Python's cyclic collector
# runs often, and each full collection walks every module, test and traced function the
# process holds: 8.6% of test_medusa.py and test_mixed.py in one process (7.3 s of 85 s,
# 24 full collections of ~0.27 s each). With what the process has imported frozen out of
# the walks and the collector run less often, it took 2.0 s and the files 76 s.


def collect_rarely():
  """For a test process, once its imports are done: what it holds now is frozen (never
  walked again; it is not garbage) and the collector runs at `GC_THRESHOLDS`."""
  gc.collect()
  gc.freeze()
  gc.set_threshold(*GC_THRESHOLDS)
