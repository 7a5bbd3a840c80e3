"""A checkpoint on disk: its directory layout (`layout`), the config saved with it
(`run_config`), the model weights in it (`weights`), and the queue megatron-core's writer
reports through (`results_queue`). Saving and loading a run's checkpoints is
`megatron_bridge.training.checkpointing`."""
