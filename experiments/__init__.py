"""mdjax's command-line jobs: decoding, benchmarks, training, reports (`python3 -m
experiments.<job>`).

A job traces and lowers many programs, which makes many short-lived Python objects, so
Python's cyclic collector runs often and each full collection walks everything the
process holds: 7-10% of a benchmark's time (`experiments.bench.speculative --quick`:
1.7 s of 18 s, 10 full collections). Run less often, it takes ~0.5 s (16 s in all)."""

import gc

GC_THRESHOLDS = (10_000, 20, 20)  # Python's defaults: (700, 10, 10)
gc.set_threshold(*GC_THRESHOLDS)
