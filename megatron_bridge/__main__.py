"""`python -m megatron_bridge ...` (and `torchrun -m megatron_bridge ...`): the `mbridge` command line."""

import sys

from megatron_bridge.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
