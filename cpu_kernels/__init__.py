"""C++ kernels for XLA:CPU, called through the XLA FFI (each beside its pure-JAX reference).

They are compiled on first use with the host's C++ compiler against the FFI headers that
jaxlib ships, and the shared library is kept in a cache folder (cpu_kernels.build).
"""
