"""TensorBoard event files: one event per log step holding all of its scalars.

Written with the `tensorboard` package's own event writer (torch's `SummaryWriter` would add a
torch import and one event per scalar).
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

from megatron_bridge.extras import require
from megatron_bridge.training.loggers.base import Record, Tracker, plain

TRAIN_MARKER = "iteration-time"
"""A key present in the metrics of every training log step (and of no evaluation)."""


class TensorBoardTracker(Tracker):
    """Scalars and the config (as text) under `log_dir`.

    `every`: write every N-th training log step (`logger.tensorboard_log_interval`); evaluation
    results are always written.
    """

    name = "tensorboard"

    def __init__(self, log_dir: str, queue_size: int = 1000, every: int = 1):
        require("tensorboard", "logger.tensorboard_dir")
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.log_dir = log_dir
        self.every = every
        self.train_steps = 0
        self.writer = EventFileWriter(log_dir, max_queue_size=queue_size)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.log_many([Record(step, metrics, time.time())])

    def log_many(self, records: Sequence[Record]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        for step, metrics, wall_time in records:
            if TRAIN_MARKER in metrics:
                self.train_steps += 1
                if self.train_steps % self.every:
                    continue
            values = [Summary.Value(tag=key, simple_value=float(value)) for key, value in metrics.items()]
            self.writer.add_event(Event(wall_time=wall_time, step=step, summary=Summary(value=values)))

    def log_config(self, config: Mapping[str, Any]) -> None:
        import yaml
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.plugins.text.metadata import create_summary_metadata

        text = "```\n" + yaml.safe_dump(plain(config), sort_keys=False) + "\n```"
        meta = create_summary_metadata(display_name="config", description="the resolved run configuration")
        tensor = TensorProto(
            dtype="DT_STRING",
            string_val=[text.encode()],
            tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]),
        )
        value = Summary.Value(tag="config/text_summary", metadata=meta, tensor=tensor)
        self.writer.add_event(Event(wall_time=time.time(), step=0, summary=Summary(value=[value])))

    def close(self, failed: bool = False) -> None:
        self.writer.flush()
        self.writer.close()
