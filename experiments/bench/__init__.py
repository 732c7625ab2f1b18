"""The benchmarks and reproductions: one module per measurement, each runnable as
`python3 -m experiments.bench.<name>` and writing its JSON and plot to
`docs/results/<name>/` by default; what they share is `experiments.bench.common`.
The index, with every command: `experiments/README.md`."""
