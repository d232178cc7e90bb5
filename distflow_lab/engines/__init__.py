"""Model engines: tokenizer and model builders / loaders used by rollout and training."""
