"""Triton kernels for the GPU path and their launch tuning; each is tested against its torch reference."""
