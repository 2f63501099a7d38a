"""Compatibility namespaces: other libraries' APIs and conventions on vjpmpi's kernels.

`vjpmpi.compat.mpi4jax`: mpi4jax 0.9's functions with mpi4jax's gradients.
"""
