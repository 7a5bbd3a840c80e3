"""Tokenizers (public import path): the config, `config.TokenizerConfig`. Tokenizers and their
config live in `megatron_bridge.runtime.tokenizers`."""
