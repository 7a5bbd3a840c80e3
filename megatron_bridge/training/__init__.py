"""Training: configs (`config`), entry points (`pretrain`, `finetune`) and the runtime behind them.

Kept empty so that importing the config layer does not import the training runtime.
"""
