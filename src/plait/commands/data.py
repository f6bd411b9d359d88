"""``plait data prepare SOURCE``: tokenise a corpus, text or JSONL source into train/val token shards,
or (``--format sft``) render, mask and pack fine-tuning rows."""

from __future__ import annotations

import argparse
import errno
import sys
from pathlib import Path


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
                      help="a built-in corpus (shakespeare, bible), a .txt file, a .jsonl/.json file with a 'text' "
                           "field per row, a .parquet/.csv/.arrow file with a 'text' column, a save_to_disk "
                           "directory, a glob of files ('data/*.parquet'), a directory of .txt/.jsonl files, or a "
                           "prepared directory (checked only)")
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
    prep.add_argument("--workers", type=int, default=1, metavar="N",
                      help="processes that tokenise (default 1; the shards are the same for any number)")
    prep.add_argument("--field", action="append", default=[], metavar="NAME=COLUMN",
                      help="read plait's field NAME (text, messages, prompt, completion, chosen, rejected, answer) "
                           "from the file's COLUMN, as data.fields in a recipe; repeatable")
    task = sub.add_parser(
        "task", help="write the built-in arithmetic fine-tuning task (SFT, preference and prompt JSONL, train and "
                     "held out)",
        description="Write sft_train.jsonl, sft_heldout.jsonl, preference_train.jsonl, preference_heldout.jsonl, "
                    "prompts_train.jsonl and prompts_heldout.jsonl of the arithmetic task (docs/post_training.md) "
                    "into DIR; deterministic for a seed.")
    task.add_argument("directory", metavar="DIR", help="output directory (created; existing task files are refused)")
    task.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the generated problems")
    task.add_argument("--train", type=int, default=2000, metavar="N",
                      help="training problems (default 2000; the task has 16228 distinct ones)")
    task.add_argument("--heldout", type=int, default=200, metavar="N",
                      help="held-out problems (default 200; the task has 4058 distinct ones)")
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


#: the largest --vocab-size trained (the BPE trainer allocates for the whole vocabulary at once: a
#: mistyped 10**12 aborts the process)
MAX_BPE_VOCAB = 1 << 20
#: errors of a path the user gave (exit status 2); other OSErrors (a full disk, I/O errors) are 1
_PATH_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EEXIST, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS,
                errno.ENAMETOOLONG, errno.ELOOP}


def _os_error(command: str, exc: OSError) -> int:
    """``plait data prepare: FILE: what`` for an OSError; status 2 for a path problem, else 1."""
    where = f"{exc.filename}: " if exc.filename else ""
    print(f"plait data {command}: {where}{exc.strerror or _one_line(exc)}", file=sys.stderr)
    return 2 if exc.errno in _PATH_ERRNOS else 1


def _file_on_the_way(path) -> object | None:
    """The first existing non-directory among ``path`` and its parents, if any (then no directory
    can be created there)."""
    from pathlib import Path

    path = Path(path).expanduser()
    return next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)


def _check_output_dirs(args: argparse.Namespace) -> str | None:
    """Why ``--out`` or ``--cache-dir`` cannot be a directory (a file is in the way), before any work."""
    for option, value in (("--out", args.out), ("--cache-dir", args.cache_dir)):
        if value is None:
            continue
        blocked = _file_on_the_way(value)
        if blocked is not None:
            what = "is a file" if str(blocked) == str(value) else f"cannot be created: {blocked} is a file"
            return f"{option} {value} {what}; give a directory"
    if args.out is not None:
        from plait.outputs.ownership import OutputDirError, require_apart

        try:  # never written over, around or into what it reads
            require_apart(args.out, [("SOURCE", args.source), ("--tokenizer", args.tokenizer)], what="--out")
        except OutputDirError as e:
            return str(e)
    return None


def _check_chat_template(tokenizer: str) -> str | None:
    """Why the chat template next to ``tokenizer`` cannot be used (unreadable, not UTF-8, does not
    compile, a broken tokenizer_config.json), before any row is read; None when it can."""
    from pathlib import Path

    from plait.data.chat_template import load_chat_template

    path = Path(tokenizer).expanduser()
    if not path.exists():
        return None  # prepare_rows names a missing tokenizer with its own fix
    try:
        load_chat_template(path)
    except ValueError as e:  # DataError, or a template file that is not UTF-8
        if not isinstance(e, UnicodeDecodeError):
            return _one_line(e)
        where = (path if path.is_dir() else path.parent) / "chat_template.jinja"
        return f"chat template {where} is not UTF-8 text ({_one_line(e)}); fix it, or remove it to use plait's " \
               f"default ChatML template"
    except OSError as e:
        return f"chat template {e.filename or path}: cannot be read ({e.strerror or e})"
    return None


def _write_task(args: argparse.Namespace) -> int:
    from pathlib import Path

    from plait.data.tasks import TASK_FILES, check_counts, write_task_files

    def fail(message: str) -> int:
        print(f"plait data task: {message}", file=sys.stderr)
        return 2

    out = Path(args.directory).expanduser()
    blocked = _file_on_the_way(out)
    if blocked is not None:  # DIR, or a folder on the way to it, is a file: nothing can be written
        what = "is a file" if blocked == out else f"cannot be created: {blocked} is a file"
        return fail(f"{out} {what}; give a directory (created if missing) to write {', '.join(TASK_FILES)} into")
    taken = [name for name in TASK_FILES if (out / name).exists()]
    if taken:
        return fail(f"{out} already holds {', '.join(taken)}; plait never replaces existing files: choose another "
                    f"directory or remove them")
    try:
        check_counts(args.train, args.heldout)  # before any work: the task has only so many distinct problems
    except ValueError as e:
        return fail(str(e))
    try:
        paths = write_task_files(out, args.seed, train=args.train, heldout=args.heldout)
    except OSError as e:  # permissions, a read-only or full disk: what was written is removed again
        return fail(f"{e.filename or out}: cannot be written ({e.strerror or e}); nothing was left behind")
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
    tokenizer_dir = Path(args.tokenizer).expanduser()
    if tokenizer_dir.is_dir() and (tokenizer_dir / "tokenizer.json").is_file():  # a directory holding one (--help)
        args.tokenizer = str(tokenizer_dir / "tokenizer.json")
    problem = _check_output_dirs(args) or _check_chat_template(args.tokenizer)
    if problem is not None:
        print(f"plait data prepare: {problem}", file=sys.stderr)
        return 2
    settings = RowsSettings(kind=args.format, seq_len=args.seq_len, packing=not args.no_packing,
                            truncation=args.truncation, train_on_prompt=args.train_on_prompt,
                            skip_bad_rows=args.skip_bad_rows, val_fraction=args.val_fraction, seed=args.seed,
                            fields=tuple(sorted(args.fields.items())))
    try:
        report = prepare_rows(args.source, args.tokenizer, settings, out_dir=args.out, cache_dir=args.cache_dir)
    except ValueError as exc:
        print(f"plait data prepare: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:
        return _os_error("prepare", exc)
    print(report.directory)
    print(f"  {report.describe()}")
    return 0


def _inapplicable_options(args: argparse.Namespace) -> str | None:
    """Options this --format ignores, named with the format they belong to (a silently dropped
    option would hide the mistake), or None."""
    if args.format == "text":
        given = [name for name, value, default in (
            ("--seq-len", args.seq_len, None), ("--no-packing", args.no_packing, False),
            ("--truncation", args.truncation, "drop"), ("--train-on-prompt", args.train_on_prompt, False),
            ("--skip-bad-rows", args.skip_bad_rows, False)) if value != default]
        if given:
            return (f"{', '.join(given)} shape{'s' if len(given) == 1 else ''} fine-tuning rows: give --format sft or "
                    f"--format preference, or drop {given[0]} (--format text writes token shards)")
        return None
    if args.workers != 1:
        return f"--workers applies to --format text only (--format {args.format} tokenises in one process); drop it"
    if args.limit is not None:
        return f"--limit applies to --format text only (--format {args.format} reads every row); drop it"
    return None


def _parse_fields(args: argparse.Namespace) -> str | None:
    """``--field NAME=COLUMN`` options into ``args.fields`` (a dict); a problem as one line, else None."""
    from plait.data.dataset_files import FIELDS

    args.fields = {}
    for item in args.field:
        name, sep, column = item.partition("=")
        if not sep or not column:
            return f"--field {item!r}: write NAME=COLUMN, e.g. --field text=body"
        if name not in FIELDS:
            return f"--field {item!r}: {name!r} is not one of plait's fields ({', '.join(FIELDS)})"
        args.fields[name] = column
    return None


def run(args: argparse.Namespace) -> int:
    if args.data_command == "task":
        return _write_task(args)
    if args.data_command != "prepare":
        print(f"plait data: unknown subcommand {args.data_command!r}; expected prepare or task", file=sys.stderr)
        return 2
    problem = _inapplicable_options(args) or _parse_fields(args)
    if args.workers < 1:
        problem = f"--workers {args.workers}: give a positive number of tokenising processes"
    if problem is not None:
        print(f"plait data prepare: {problem}", file=sys.stderr)
        return 2
    if args.format in ("sft", "preference"):
        return _prepare_rows(args)
    problem = _check_output_dirs(args)
    if args.limit is not None and args.limit > sys.maxsize:
        args.limit = None  # more documents than any corpus holds: all of them
    if args.tokenizer == "bpe" and args.vocab_size > MAX_BPE_VOCAB:
        problem = f"--vocab-size {args.vocab_size}: a trained BPE has at most {MAX_BPE_VOCAB} tokens (the trainer " \
                  f"reserves memory for all of them); give a smaller --vocab-size"
    if problem is not None:
        print(f"plait data prepare: {problem}", file=sys.stderr)
        return 2
    from plait.data.checks import verify_prepared
    from plait.data.prepare import prepare_dataset_ex

    try:
        path, reused = prepare_dataset_ex(args.source, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                                          val_fraction=args.val_fraction, out_dir=args.out, seed=args.seed,
                                          progress=not args.no_progress, limit=args.limit,
                                          cache_dir=args.cache_dir, fields=args.fields, workers=args.workers)
        index = verify_prepared(path).index  # the same checks as plait train (a reused directory may be damaged)
    except ValueError as exc:  # DataError and argument errors: one line naming the file
        print(f"plait data prepare: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:
        return _os_error("prepare", exc)
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
