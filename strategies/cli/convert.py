"""``stratpack convert``: a checkpoint directory (DCP, or the pack's gathered format) as one file (the whole
checkpoint, or the model's weights), or with ``--hf`` as a Hugging Face ``save_pretrained`` directory; with ``--dcp``
any model's weights (DCP in any layout, ``save_pretrained``, one file) as a DCP directory in torchtitan's layout. The
two directory outputs read and write one tensor at a time."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="a sharded checkpoint directory -> one file (torch.save)")
    p.add_argument("checkpoint", help="the sharded checkpoint directory (e.g. epoch=0-step=3.ckpt)")
    p.add_argument("out", help="the file to write")
    p.add_argument("--model-only", action="store_true",
                   help="write only the model's state_dict, which model.load_state_dict accepts")
    p.add_argument("--strip-prefix", default="", help="with --model-only or --hf: keep keys under this prefix, "
                   "without it (e.g. 'model.' for the nn.Module inside the LightningModule; with --hf found where "
                   "only one fits)")
    p.add_argument("--hf", metavar="CONFIG", default=None,
                   help="write OUT as a Hugging Face save_pretrained directory (safetensors by block, their index, "
                   "the config) of the model CONFIG describes (a directory with its config.json), reading one "
                   "tensor at a time")
    p.add_argument("--dcp", action="store_true",
                   help="write OUT as a DCP directory of the model's weights in torchtitan's layout (model.<name>), "
                   "reading one tensor at a time: from a DCP directory in any layout (the pack's, Lightning's "
                   "ModelParallelStrategy's, torchtitan's, FSDP2's), a Hugging Face save_pretrained directory, or a "
                   "torch.save file (a state dict, or a Lightning checkpoint's state_dict)")
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    from strategies.checkpoint import CheckpointError, convert, read_manifest
    from strategies.checkpoint.dcp_dir import describe
    from strategies.checkpoint.directory import is_dcp

    if args.hf:
        return _to_pretrained(args)
    if args.dcp:
        return _to_dcp(args)
    try:
        if is_dcp(args.checkpoint):
            plan, ranks = describe(args.checkpoint)
        else:
            manifest = read_manifest(args.checkpoint)
            plan, ranks = manifest.get("plan", "?"), manifest["world_size"]
        obj = convert(args.checkpoint, args.out, model_only=args.model_only, strip_prefix=args.strip_prefix)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    what = f"model state_dict ({len(obj)} tensors)" if args.model_only else "Lightning checkpoint"
    print(f"{args.out}: {what} from a {plan} checkpoint written as {ranks} part(s)")
    return 0


def _to_pretrained(args: argparse.Namespace) -> int:
    from strategies.checkpoint import CheckpointError
    from strategies.checkpoint.pretrained import sharded_to_pretrained

    try:
        files = sharded_to_pretrained(args.checkpoint, args.out, args.hf, args.strip_prefix)
    except (CheckpointError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{args.out}: a Hugging Face directory in {len(files)} safetensors files (from_pretrained loads it)")
    return 0


def _to_dcp(args: argparse.Namespace) -> int:
    from strategies.checkpoint import CheckpointError
    from strategies.checkpoint.dcp_dir import save_lazily
    from strategies.checkpoint.directory import is_sharded
    from strategies.checkpoint.pretrained import open_weights

    try:
        if is_sharded(args.checkpoint):
            raise CheckpointError(f"{args.checkpoint} is in the pack's earlier gathered format: convert it to one file "
                                  "first (stratpack convert IN FILE --model-only), then that file with --dcp")
        source = open_weights(args.checkpoint)
        entries = {k: v for k, v in source.entries().items() if k.startswith(args.strip_prefix)}
        if not entries:
            raise CheckpointError(f"{args.checkpoint} holds no weights under {args.strip_prefix!r}")
        save_lazily({k.removeprefix(args.strip_prefix): v for k, v in entries.items()},
                    lambda name: source.tensor(args.strip_prefix + name), args.out)
    except (CheckpointError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{args.out}: a DCP directory of {len(entries)} tensors under model. (torchtitan's layout; "
          "strategies.load_pretrained and torch.distributed.checkpoint.load read it)")
    return 0
