"""Loaded by every Python process that has tests/standin/runtime on its path: when NEURON_STANDIN_SALT is
set, the stand-in runtime watches XLA:CPU's compiles as libneuronxla watches Neuron's."""

import os

if os.environ.get("NEURON_STANDIN_SALT"):
    from libneuronxla import _standin

    _standin.install()

if os.environ.get("STANDIN_FAULT") == "wrong-data":
    import standin_faults

    standin_faults.install_wrong_data()
