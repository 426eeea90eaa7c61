"""Model definitions and loaders (Hugging Face directories, GGUF, the embedded default)."""
