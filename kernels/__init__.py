"""Triton kernels for the GPU path, each with the pure-torch reference it is tested against.

Kernels take tensors only: they know nothing of requests, sequences or schedulers.
"""
