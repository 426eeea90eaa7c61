"""Tensor parallelism: N processes, each holding 1/N of the weights and of the KV-cache heads."""
