"""The former import path of `megatron_bridge.runtime.tokenizers.tokenizer`, kept for code that uses it:
this name is that same module (one module object, so its state and any patch are shared)."""

import sys

from megatron_bridge.runtime.tokenizers import tokenizer as _module

sys.modules[__name__] = _module
