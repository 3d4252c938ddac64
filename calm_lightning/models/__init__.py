"""Model loading (embedded GGUF, hub, tiny), LoRA wrapping and the logit-adjustment head."""
