"""Policies as HF models: local checkpoints, random-weight shapes of the paper's models,
the tiny CPU model with its tokenizer, and SmolLM2 converted from a GGUF file."""
