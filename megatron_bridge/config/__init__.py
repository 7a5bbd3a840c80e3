"""The machinery shared by every config class: user-set tracking, deferred finalize, type checks,
and the one error type for configuration problems. The configs of a training run live in
`megatron_bridge.training.config`."""
