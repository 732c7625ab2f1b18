"""ml_collections configs for `python -m experiments.decode --config=configs/<name>.py`."""
