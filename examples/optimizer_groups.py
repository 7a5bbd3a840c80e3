"""Per-parameter optimizer settings with an `OptimizerConfigOverrideProvider`: no weight decay on
norms and biases, and a lower learning rate for the embedding.

    python examples/optimizer_groups.py --dir runs/example_groups --train-iters 20
"""

from __future__ import annotations

import argparse

from megatron_bridge.training.callbacks import Callback
from megatron_bridge.training.config import OptimizerConfigOverrideProvider
from megatron_bridge.training.gpt_step import forward_step
from megatron_bridge.training.pretrain import pretrain
from recipes import tiny_gpt_pretrain_config


class NoDecayOnNormsLowerEmbeddingLR(OptimizerConfigOverrideProvider):
    """Groups of parameters, keyed by megatron-core `ParamKey`s (names as fnmatch patterns,
    attributes, predicates), each with the settings it overrides (`ParamGroupOverride`)."""

    embedding_lr_scale: float = 0.1

    def build_config_overrides(self, context):
        from megatron.core.optimizer import ParamKey, ParamPredicate

        opt = context.optimizer_config
        one_dimensional = ParamPredicate(name="1d", fn=lambda param: param.dim() == 1)
        return {
            # biases and norm weights (every 1-D parameter): no weight decay
            ParamKey(name="*.bias", predicate=one_dimensional): {"wd_mult": 0.0},
            # the word embedding: a tenth of the learning rate, over the same schedule
            ParamKey(name="*word_embeddings.weight"): {
                "max_lr": opt.lr * self.embedding_lr_scale,
                "min_lr": opt.min_lr * self.embedding_lr_scale,
            },
        }


class PrintGroups(Callback):
    """Prints the optimizer's parameter groups once training starts."""

    def on_train_start(self, state):
        for group in state.optimizer.param_groups:
            print(f"group: {len(group['params'])} tensors, max_lr {group['max_lr']:.2e}, wd_mult {group['wd_mult']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="runs", help="where checkpoints and logs go")
    parser.add_argument("--train-iters", type=int, default=100)
    args = parser.parse_args()

    cfg = tiny_gpt_pretrain_config(dir=args.dir, name="example_groups", train_iters=args.train_iters)
    cfg.optimizer_config_override_provider = NoDecayOnNormsLowerEmbeddingLR()
    pretrain(cfg, forward_step, callbacks=[PrintGroups()])


if __name__ == "__main__":  # the checkpoint writer re-imports this file in its helper processes
    main()
