"""Which JAX backends a process starts: on a host with no GPU and no TPU, the CPU alone.

jax starts every backend it finds a plugin for. With the packages that compile for GPU and
TPU targets installed (`mdjax.compile_targets`, requirements-compile-targets.txt), a plain
`import jax; jax.devices()` on a CPU-only machine therefore prints a CUDA plugin traceback
("Unable to load cuDNN") and libtpu's warnings before it falls back to the CPU. `choose`,
run by `import mdjax` before any backend starts, asks for the CPU alone where the host
shows no accelerator, so the main job, the experiments and the notebooks start quietly;
the compile targets still load the plugin and libtpu when a program is compiled for them.

    host shows                          JAX_PLATFORMS / jax_platforms      mdjax sets
    a GPU or a TPU                      anything                           nothing
    neither                             set by the user                    nothing
    neither                             unset                              "cpu"

A host shows a GPU by its driver's device files (/dev/nvidia0, AMD's /dev/kfd), a TPU by
Google's PCI vendor id or the TPU's device files (/dev/accel*, /dev/vfio/<n>).
"""

from __future__ import annotations

import glob
import pathlib

import jax

GOOGLE_PCI_VENDOR = "0x1ae0"
ACCELERATOR_FILES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*")


def host_has_accelerator() -> bool:
  """Whether this host shows a GPU or a TPU (see the module's table)."""
  if any(glob.glob(pattern) for pattern in ACCELERATOR_FILES):
    return True
  return any(pathlib.Path(vendor).read_text().strip() == GOOGLE_PCI_VENDOR
             for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"))


def choose() -> None:
  """The CPU alone where the host shows no accelerator and the user chose no platform.
  Call before any backend starts (a started backend keeps its platforms)."""
  if not jax.config.jax_platforms and not host_has_accelerator():
    jax.config.update("jax_platforms", "cpu")
