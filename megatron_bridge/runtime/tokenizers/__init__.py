"""Tokenizers: which one a run uses (`config.TokenizerConfig`) and building it (`tokenizer`)."""
