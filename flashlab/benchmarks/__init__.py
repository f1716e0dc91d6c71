"""The ``python -m flashlab bench ...`` command lines (imported on demand, never by the library).

- ``bench`` (:mod:`~flashlab.benchmarks.backends`): every backend on this device.
- ``bench tiled`` (:mod:`~flashlab.benchmarks.tiled`): the tiled rung on CPU.
- ``bench tpu-static`` (:mod:`~flashlab.benchmarks.tpu_static`): flashlab vs splash vs jax flash
  on the TPU compiler's static schedule; ``bench tpu-blocks``
  (:mod:`~flashlab.benchmarks.tpu_blocks`): the default-blocks table from its stored runs.
- ``bench ring`` (:mod:`~flashlab.benchmarks.ring`; ``--step-model``:
  :mod:`~flashlab.benchmarks.ring_step`), ``bench generate`` (:mod:`~flashlab.benchmarks.generate`).
"""
