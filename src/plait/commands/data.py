"""``plait data prepare SOURCE``: tokenise a corpus, text or JSONL source into train/val token shards."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "data", help="prepare training data (tokenised train/val token shards)",
        description="Prepare datasets for training. See docs/data.md for the format.")
    sub = parser.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    prep = sub.add_parser(
        "prepare", help="tokenise SOURCE into train/val token shards",
        description="Tokenise SOURCE into memory-mapped train/val token shards with an index.json and the "
                    "tokenizer. Rerunning with the same inputs returns the existing directory at once.")
    prep.add_argument("source", metavar="SOURCE",
                      help="a built-in corpus (shakespeare, bible), a .txt file, a .jsonl file with a 'text' field "
                           "per line, a directory of .txt/.jsonl files, or a prepared directory (checked only)")
    prep.add_argument("--tokenizer", default="bpe", metavar="bpe|PATH",
                      help="'bpe' trains a byte-level BPE on the training documents (default), or the path of a "
                           "tokenizer.json (or a directory holding one)")
    prep.add_argument("--vocab-size", type=int, default=2048, metavar="N",
                      help="vocabulary size of the trained BPE (default 2048; ignored with a tokenizer PATH)")
    prep.add_argument("--val-fraction", type=float, default=0.05, metavar="F",
                      help="share of the tokens held out for validation, as whole documents (default 0.05)")
    prep.add_argument("--out", default=None, metavar="DIR",
                      help="output directory (default: <cache>/datasets/<name>-<key>)")
    prep.add_argument("--cache-dir", default=None, metavar="DIR",
                      help="plait's cache, as data.cache_dir in a recipe (default: $PLAIT_CACHE or ~/.cache/plait)")
    prep.add_argument("--seed", type=int, default=0, metavar="S", help="seed choosing the validation documents")
    prep.add_argument("--limit", type=int, default=None, metavar="N", help="use only the first N documents")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def run(args: argparse.Namespace) -> int:
    if args.data_command != "prepare":
        print(f"plait data: unknown subcommand {args.data_command!r}; expected prepare", file=sys.stderr)
        return 2
    from plait.data.checks import verify_prepared
    from plait.data.prepare import prepare_dataset_ex

    try:
        path, reused = prepare_dataset_ex(args.source, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                                          val_fraction=args.val_fraction, out_dir=args.out, seed=args.seed,
                                          progress=not args.no_progress, limit=args.limit,
                                          cache_dir=args.cache_dir)
        index = verify_prepared(path).index  # the same checks as plait train (a reused directory may be damaged)
    except ValueError as exc:  # DataError and argument errors: one line naming the file
        print(f"plait data prepare: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"plait data prepare: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("plait data prepare: interrupted (nothing was left behind)", file=sys.stderr)
        return 130
    print(path)
    for split in ("train", "val"):
        entry = index["splits"][split]
        shards = len(entry["shards"])
        print(f"  {split:<5} {entry['tokens']:>13,} tokens  {entry['documents']:>8,} documents  "
              f"{shards} shard{'s' if shards != 1 else ''}")
    print(f"  vocab {index['vocab_size']}, eos id {index['eos_id']} ({index['eos_token']}), {index['dtype']}"
          f"{', reused existing directory' if reused else ''}")
    return 0
