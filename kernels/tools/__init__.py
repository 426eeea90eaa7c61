"""Developer tools for the kernels: micro-benchmarks (`bench`) and the Triton compile check."""
