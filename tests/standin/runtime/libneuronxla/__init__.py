"""Test stand-in of the Neuron runtime's compile cache (the real libneuronxla ships inside torch-neuronx).

It keeps the real package's public interface (neuron_cc_cache, neuron_parallel_compile.parallel_compile) and
its on-disk contract, and names modules with a key the code under test cannot predict: a hash of the module
XLA really compiled, salted with NEURON_STANDIN_SALT (chosen per test). See _standin.py.
"""
