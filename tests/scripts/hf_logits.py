"""Load a Hugging Face directory into our megatron-core model under the current launch and save
the logits of fixed tokens (from the last rank, which is on the last pipeline stage).

    torchrun --nproc_per_node=2 tests/scripts/hf_logits.py --hf DIR --tp 2 --out logits.pt
"""

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from hf_models import megatron_logits, random_tokens  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--backend", default="auto", help="process-group backend (tests: factories.backend_for)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    logits = megatron_logits(args.hf, random_tokens(args.vocab), tp=args.tp, pp=args.pp, ep=args.ep, backend=args.backend)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if rank == world - 1:
        torch.save(logits, args.out)


if __name__ == "__main__":
    main()
