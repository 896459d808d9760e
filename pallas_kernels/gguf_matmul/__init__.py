"""llama.cpp's block formats on the GPU: the planes each format is split into at load and the
pure-JAX reference (reference.py), and the Pallas kernel that dequantizes them per tile
(kernel.py); the CPU kernel reading the blocks in place is cpu_kernels.gguf_matmul."""
