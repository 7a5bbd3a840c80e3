"""The machinery shared by every config class: user-set tracking, deferred finalize, the field
annotation interpreter (`annotations`), YAML (`serialization`, `yaml_input`), overrides (`overrides`,
`interpolation`) and the one way of applying them (`apply`), type checks,
and the one error type for configuration problems. The configs of a training run live in
`megatron_bridge.training.config`."""
