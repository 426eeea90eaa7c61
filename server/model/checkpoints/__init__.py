"""Model sources read into a `Checkpoint`: Hugging Face directories (safetensors), GGUF files, their tokenizer files and pooling."""
