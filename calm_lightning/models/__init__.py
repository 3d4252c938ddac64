"""Model loading (embedded GGUF, hub, tiny), LoRA wrapping, the logit-adjustment head and its
logits processor for `generate`."""
