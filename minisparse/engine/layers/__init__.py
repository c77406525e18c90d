"""The engine's layers: attention over the paged pool, the sampler, and the Triton kernels
that replace their PyTorch paths on CUDA (reached through minisparse.utils.kernels)."""
