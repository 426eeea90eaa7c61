"""Benchmarks: `kubeinfer bench serve` (online, any OpenAI endpoint) and `kubeinfer bench throughput` (offline engine)."""
