"""The former import path of `megatron_bridge.runtime.cpu_backend`, kept for code that uses it:
this name is that same module (one module object, so its state and any patch are shared)."""

import sys

from megatron_bridge.runtime import cpu_backend as _module

sys.modules[__name__] = _module
