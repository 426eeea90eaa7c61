"""Model definitions and loaders (Hugging Face directories, GGUF, the embedded default): `families/`
built from `layers/`, read from `checkpoints/`, with `tokenizer/`, LoRA `adapters/` and `quantization/`;
`registry.py` names the families, `loader.py` puts them together."""
