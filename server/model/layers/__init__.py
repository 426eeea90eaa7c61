"""The model's building blocks: attention and its backends, linear, MLP, MoE, norm, rotary, the KV cache's fp8 scales."""
