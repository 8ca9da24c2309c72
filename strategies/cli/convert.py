"""``stratpack convert``: a sharded checkpoint directory as one file (the whole checkpoint, or the model's weights)."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="a sharded checkpoint directory -> one file (torch.save)")
    p.add_argument("checkpoint", help="the sharded checkpoint directory (e.g. epoch=0-step=3.ckpt)")
    p.add_argument("out", help="the file to write")
    p.add_argument("--model-only", action="store_true",
                   help="write only the model's state_dict, which model.load_state_dict accepts")
    p.add_argument("--strip-prefix", default="", help="with --model-only: keep keys under this prefix, without it "
                   "(e.g. 'model.' for the nn.Module inside the LightningModule)")
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    from strategies.checkpoint import CheckpointError, convert, read_manifest

    try:
        manifest = read_manifest(args.checkpoint)
        obj = convert(args.checkpoint, args.out, model_only=args.model_only, strip_prefix=args.strip_prefix)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    what = f"model state_dict ({len(obj)} tensors)" if args.model_only else "Lightning checkpoint"
    print(f"{args.out}: {what} from a {manifest.get('plan', '?')} checkpoint of {manifest['world_size']} rank(s)")
    return 0
