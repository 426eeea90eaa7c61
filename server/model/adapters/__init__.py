"""LoRA adapters: PEFT reading, the device slots inside the model, and the adapter registry."""
