"""Former home of `process_config_with_overrides`; it lives in `megatron_bridge.config.apply`."""

from megatron_bridge.config.overrides import process_config_with_overrides  # noqa: F401
