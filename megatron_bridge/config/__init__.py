"""The machinery shared by every config class: user-set tracking, deferred finalize, field
annotations (`annotations`: what a type allows; `codec`: values to plain data and back), YAML
(`serialization`, `yaml_input`), overrides (`overrides`, `interpolation`) and the one way of
applying them (`apply`), and the one error type for configuration problems. The configs of a
training run live in `megatron_bridge.training.config`."""
