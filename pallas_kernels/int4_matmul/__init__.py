"""4-bit weights in groups: the format and pure-JAX reference (reference.py) and the Pallas
GPU kernel (kernel.py); the CPU kernel is cpu_kernels.matmul's int4_matmul."""
