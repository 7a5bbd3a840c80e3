"""Former home of config YAML serialization; it lives in `megatron_bridge.config.serialization`."""

from megatron_bridge.config.serialization import from_dict, from_yaml, to_dict, to_yaml  # noqa: F401
