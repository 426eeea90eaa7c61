"""The serving tokenizer: encode/decode, chat templates, and tokenizers rebuilt from GGUF metadata."""
