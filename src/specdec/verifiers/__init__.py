"""Reference verifiers: token trees checked against a Hugging Face causal LM (CPU or CUDA)."""
