"""Tokenizers: the config (`config.TokenizerConfig`) and the builder used at setup."""
