"""The `mbridge` command line: one module per subcommand, dispatched by `main.py`.

Each subcommand module exposes `register(subparsers)`, which adds its parser and sets
`handler=fn(args) -> int`. Modules import torch, megatron-core and the recipes only inside their
handlers, so `mbridge --help` stays fast.
"""
