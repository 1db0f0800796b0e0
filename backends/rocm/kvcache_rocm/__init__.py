"""kvcache backend plugin ``rocm``: AMD GPUs through torch on HIP and the CUDA package's Triton
kernels. Importing this package never requires torch or a GPU; availability says why not."""
