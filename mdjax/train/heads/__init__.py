"""The heads trainer, one module per job (`run`'s docstring draws them): `inputs` (the
run's data and its cache), `features` (the cache on disk and its one writer), `batches`,
`objective` (the objective, the step, the held-out evaluation), `card` (the export and
its model card) and `run` (`validate`, `train`). The data set it may read is
`mdjax.train.head_data`'s."""

from mdjax.train.heads.run import Run, train, validate

__all__ = ["Run", "train", "validate"]
