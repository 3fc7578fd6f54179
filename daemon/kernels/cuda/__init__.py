"""numba-CUDA kernels of the GPU backend (one file per concern; shapes and legends in each file)."""
