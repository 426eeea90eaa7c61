"""One module per model family (a `CausalLM` subclass built from `layers/`), registered in `registry.py`."""
