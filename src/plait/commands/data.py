"""``plait data prepare SOURCE``: tokenise a corpus, text or JSONL source into train/val token shards,
or (``--format sft``) render, mask and pack fine-tuning rows."""

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
    task = sub.add_parser(
        "task", help="write the built-in arithmetic fine-tuning task (SFT and preference JSONL, train and held out)",
        description="Write sft_train.jsonl, sft_heldout.jsonl, preference_train.jsonl and preference_heldout.jsonl "
                    "of the arithmetic task (docs/post_training.md) into DIR; deterministic for a seed.")
    task.add_argument("directory", metavar="DIR", help="output directory (created; existing task files are refused)")
    task.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the generated problems")
    task.add_argument("--train", type=int, default=2000, metavar="N", help="training problems (default 2000)")
    task.add_argument("--heldout", type=int, default=200, metavar="N", help="held-out problems (default 200)")
    sft = prep.add_argument_group("fine-tuning rows (--format sft; see docs/post_training.md)")
    sft.add_argument("--format", choices=("text", "sft", "preference"), default="text",
                     help="'text' (default): documents to token shards; 'sft': a .jsonl of conversations or "
                          "prompt/completion rows, rendered with the tokenizer's chat template; 'preference': "
                          "rows with a prompt (or messages) and chosen/rejected answers")
    sft.add_argument("--seq-len", type=int, default=None, metavar="N", help="row length in tokens (required for sft)")
    sft.add_argument("--no-packing", action="store_true", help="one sample per row (default: packed)")
    sft.add_argument("--truncation", choices=("drop", "truncate_left", "truncate_right"), default="drop",
                     help="samples longer than --seq-len (default drop); counted in the report")
    sft.add_argument("--train-on-prompt", action="store_true", help="loss on every token, not only the assistant's")
    sft.add_argument("--skip-bad-rows", action="store_true", help="skip malformed rows (counted) instead of stopping")
    return parser


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _write_task(args: argparse.Namespace) -> int:
    from pathlib import Path

    from plait.data.tasks import TASK_FILES, write_task_files

    out = Path(args.directory).expanduser()
    taken = [name for name in TASK_FILES if (out / name).exists()]
    if taken:
        print(f"plait data task: {out} already holds {', '.join(taken)}; plait never replaces existing files: "
              f"choose another directory or remove them", file=sys.stderr)
        return 2
    if args.train < 1 or args.heldout < 1:
        print("plait data task: --train and --heldout must be at least 1", file=sys.stderr)
        return 2
    paths = write_task_files(out, args.seed, train=args.train, heldout=args.heldout)
    for path in paths.values():
        print(path)
    return 0


def _prepare_rows(args: argparse.Namespace) -> int:
    from plait.data.sft_prepare import RowsSettings, prepare_rows

    if args.seq_len is None or args.seq_len < 2:
        print(f"plait data prepare: --format {args.format} needs --seq-len N (N >= 2), the row length of the recipe's "
              "data.seq_len", file=sys.stderr)
        return 2
    if args.tokenizer == "bpe":
        print(f"plait data prepare: --format {args.format} needs --tokenizer PATH (the model's tokenizer.json; its "
              "tokenizer_config.json gives the chat template)", file=sys.stderr)
        return 2
    settings = RowsSettings(kind=args.format, seq_len=args.seq_len, packing=not args.no_packing,
                            truncation=args.truncation, train_on_prompt=args.train_on_prompt,
                            skip_bad_rows=args.skip_bad_rows, val_fraction=args.val_fraction, seed=args.seed)
    try:
        report = prepare_rows(args.source, args.tokenizer, settings, out_dir=args.out, cache_dir=args.cache_dir)
    except ValueError as exc:
        print(f"plait data prepare: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"plait data prepare: {_one_line(exc)}", file=sys.stderr)
        return 1
    print(report.directory)
    print(f"  {report.describe()}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.data_command == "task":
        return _write_task(args)
    if args.data_command != "prepare":
        print(f"plait data: unknown subcommand {args.data_command!r}; expected prepare or task", file=sys.stderr)
        return 2
    if args.format in ("sft", "preference"):
        return _prepare_rows(args)
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
