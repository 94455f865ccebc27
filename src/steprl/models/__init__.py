"""Models: the embedded tiny policy (tokenizer + Llama-architecture config) and its SFT warm start."""
