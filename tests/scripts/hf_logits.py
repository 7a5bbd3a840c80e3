"""Load a Hugging Face directory into our megatron-core model under the current launch and save
the logits of fixed tokens (from the last rank, which is on the last pipeline stage).

    torchrun --nproc_per_node=2 tests/scripts/hf_logits.py --hf DIR --tp 2 --out logits.pt [--import-to CKPT [--export-to DIR]]
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
    p.add_argument("--import-to", help="then import the directory into a checkpoint here, in the same layout")
    p.add_argument("--export-to", help="then export that checkpoint to a Hugging Face directory here, in the same layout")
    p.add_argument("--check-projection-norm", action="store_true", help="then run projection_norm_tp.py's check")
    args = p.parse_args()
    import torch.distributed as dist

    from megatron_bridge.runtime.distributed import resolve_backend

    # One process group for every step (a group made again on torchrun's store finds stale peers).
    dist.init_process_group(resolve_backend(args.backend))
    logits = megatron_logits(args.hf, random_tokens(args.vocab), tp=args.tp, pp=args.pp, ep=args.ep, backend=args.backend)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if rank == world - 1:
        torch.save(logits, args.out)
    if args.import_to:
        from megatron_bridge.models.hf.convert import import_hf

        import_hf(args.hf, args.import_to, tp=args.tp, pp=args.pp, ep=args.ep, backend=args.backend)
    if args.export_to:
        from megatron_bridge.models.hf.convert import export_checkpoint

        export_checkpoint(args.import_to, args.export_to, tp=args.tp, pp=args.pp, ep=args.ep, backend=args.backend,
                          max_shard_bytes=100_000)  # fmt: skip
    if args.check_projection_norm:
        from projection_norm_tp import check_projection_norm

        check_projection_norm()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
