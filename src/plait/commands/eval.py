"""``plait eval MODEL --data FILE``: held-out exact match (SFT rows) or preference accuracy
(preference rows) of a Hugging Face model directory or a LoRA adapter directory;
``plait eval MODEL --lm-eval TASK[,TASK]``: lm-evaluation-harness tasks on the same model, scored by
plait's own forward (:mod:`plait.evaluation`), in one process or over ``--tp N`` local ranks."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: the default answer length cap of SFT rows
ANSWER_TOKENS = 16
#: prompts decoded together (SFT rows) when --batch-size is not given
SFT_BATCH = 32
#: requests per forward (lm-eval tasks) when --batch-size is not given
LM_EVAL_BATCH = 8


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "eval", help="score a model on held-out rows (exact match, preference accuracy) or on lm-eval tasks",
        description="Score MODEL (a Hugging Face directory, or a run's final LoRA adapter directory) on a .jsonl "
                    "of held-out rows (--data): SFT rows by exact match of the greedy answer to the last assistant "
                    "turn, preference rows by how often the chosen answer is more likely than the rejected one; "
                    "or on lm-evaluation-harness tasks (--lm-eval), built-in or local YAMLs (--lm-eval-include). "
                    "See docs/post_training.md and docs/evaluation.md.")
    p.add_argument("model", metavar="MODEL", help="Hugging Face model directory, a packaged model's name "
                   "(smollm2-135m-instruct), or a PEFT adapter directory")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--data", metavar="FILE", help="held-out rows (.jsonl), e.g. from `plait data task`")
    what.add_argument("--lm-eval", metavar="TASK[,TASK]", dest="lm_eval",
                      help="lm-evaluation-harness task, group or tag names (or task YAML paths), comma-separated")
    p.add_argument("--lm-eval-include", metavar="DIR", default=None,
                   help="--lm-eval: a directory of local task YAMLs (lm-eval's include_path)")
    p.add_argument("--num-fewshot", type=int, default=None, metavar="N",
                   help="--lm-eval: few-shot examples per prompt (default: each task's own)")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="--lm-eval: tensor-parallel degree, N local ranks (gloo on CPU, NCCL on CUDA; default 1)")
    p.add_argument("--kind", choices=("auto", "sft", "preference", "prompts"), default="auto",
                   help="row kind (default: preference when the first row has 'chosen', prompts (GRPO's rows, "
                        "scored against their 'answer') when it has 'answer', else sft)")
    p.add_argument("--base", default=None, metavar="DIR", help="base model of an adapter (default: the adapter's "
                                                               "base_model_name_or_path)")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="score only the first N rows (--lm-eval: the first N documents of each task)")
    p.add_argument("--max-new-tokens", type=int, default=ANSWER_TOKENS, metavar="N",
                   help=f"answer length cap (sft; default {ANSWER_TOKENS})")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help=f"sft: prompts decoded together (default {SFT_BATCH}); --lm-eval: requests per forward "
                        f"(default {LM_EVAL_BATCH}); fewer uses less memory")
    p.add_argument("--json", action="store_true", help="print the scores as one JSON line")
    return p


def _kind(path: Path) -> str:
    """``preference`` when the first non-blank line is an object with ``chosen``, ``prompts`` when it
    has ``answer``, else ``sft``;
    bytes that are not UTF-8 or JSON are left to the row reader, which names the line."""
    with path.open("rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    row = json.loads(raw.decode("utf-8"))
                except ValueError:  # not UTF-8, or not JSON
                    return "sft"
                if isinstance(row, dict) and "chosen" in row:
                    return "preference"
                return "prompts" if isinstance(row, dict) and "answer" in row else "sft"
    return "sft"


def _fail(message: str) -> int:
    print(f"plait eval: {' '.join(message.split())}", file=sys.stderr)
    return 2


def _context_of(model_dir: Path) -> int | None:
    """``max_position_embeddings`` of a Hugging Face directory's config.json (None when unreadable:
    loading the model names the problem)."""
    try:
        value = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def _lm_eval_options_check(args: argparse.Namespace) -> str | None:
    """The first option given that does not apply to the chosen mode, as a message (None: none)."""
    if args.lm_eval is None:
        given = [o for o, v in (("--lm-eval-include", args.lm_eval_include), ("--num-fewshot", args.num_fewshot))
                 if v is not None] + (["--tp"] if args.tp != 1 else [])
        if given:
            return f"{given[0]} applies to --lm-eval tasks, not to --data rows; drop it"
        return None
    if args.kind != "auto":
        return f"--kind {args.kind} applies to --data rows; lm-eval tasks name their own kind; drop it"
    if args.max_new_tokens != ANSWER_TOKENS:
        return (f"--max-new-tokens {args.max_new_tokens} applies to --data rows; an lm-eval task sets its own "
                f"max_gen_toks in its generation_kwargs; drop it")
    return None


def _run_lm_eval(args: argparse.Namespace) -> int:
    """``--lm-eval``: the model and task directory checked, the task names checked (close matches
    named), then the model loads and the tasks run; a table of metrics, or one JSON line."""
    from plait.heldout import scoring_model_dir

    if args.limit is not None and args.limit < 1:
        return _fail(f"--limit {args.limit} must be at least 1")
    batch = LM_EVAL_BATCH if args.batch_size is None else args.batch_size
    if batch < 1:
        return _fail(f"--batch-size {batch} must be at least 1")
    if args.tp < 1:
        return _fail(f"--tp {args.tp} must be at least 1")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        return _fail(f"--num-fewshot {args.num_fewshot} must be 0 or more")
    try:
        model_dir, base_dir, _ = scoring_model_dir(args.model, args.base, need_tokenizer=True)
        if args.lm_eval_include is not None and not Path(args.lm_eval_include).expanduser().is_dir():
            return _fail(f"--lm-eval-include {args.lm_eval_include}: no such directory; give the directory of your "
                         f"task YAML files")
        from plait.evaluation.run import EvalSpec, evaluate_model, evaluate_model_tp, tp_mesh

        if args.tp > 1:  # the model splits over --tp ranks (from its config.json alone)
            tp_mesh(base_dir or model_dir, args.tp, 0, create_groups=False)
        from plait.evaluation.harness import metrics_table, parse_task_names, task_manager

        names = parse_task_names(args.lm_eval)
        task_manager(names, args.lm_eval_include)  # unknown names fail here, before the model loads
        spec = EvalSpec(model=args.model, tasks=tuple(names), include=args.lm_eval_include, limit=args.limit,
                        batch_size=batch, num_fewshot=args.num_fewshot, base=args.base)
        rows = evaluate_model(spec) if args.tp == 1 else evaluate_model_tp(spec, args.tp)
        assert rows is not None, "one process, or the launcher's local rank 0, gets the rows"
    except (ValueError, OSError) as e:  # LmEvalError, DataError, HeadLayoutError, missing files: one line
        return _fail(str(e))
    if args.json:
        print(json.dumps({"tasks": list(names), "metrics": [r.as_dict() for r in rows]}))
    else:
        print(metrics_table(rows))
    return 0


def run(args: argparse.Namespace) -> int:
    inapplicable = _lm_eval_options_check(args)
    if inapplicable is not None:
        return _fail(inapplicable)
    if args.lm_eval is not None:
        return _run_lm_eval(args)
    return _run_rows(args)


def _run_rows(args: argparse.Namespace) -> int:
    from safetensors import SafetensorError

    from plait.data.tokenizer import load_tokenizer_file
    from plait.heldout import (
        exact_match,
        load_scoring_model,
        preference_accuracy,
        scoring_model_dir,
        scoring_rows,
        scoring_template,
    )

    data = Path(args.data).expanduser()
    if data.is_dir():
        return _fail(f"--data {args.data}: is a directory; give the .jsonl file of held-out rows")
    if not data.is_file():
        return _fail(f"--data {args.data}: no such file")
    if args.limit is not None and args.limit < 1:
        return _fail(f"--limit {args.limit} must be at least 1")
    if args.batch_size is not None and args.batch_size < 1:
        return _fail(f"--batch-size {args.batch_size} must be at least 1")
    if args.max_new_tokens < 1:
        return _fail(f"--max-new-tokens {args.max_new_tokens} must be at least 1 (the answer's length cap)")
    try:
        # the paths first, then every row (an empty file is refused), then the model loads
        model_dir, base_dir, tokenizer_dir = scoring_model_dir(args.model, args.base, need_tokenizer=True)
        if args.base is not None and base_dir is None:
            return _fail(f"--base {args.base} applies to a LoRA adapter directory, and {model_dir} is a whole model "
                         f"(no adapter_config.json), scored as it is; drop --base")
        scoring_template(tokenizer_dir, load_tokenizer_file(tokenizer_dir / "tokenizer.json"))  # loads, compiles
        kind = _kind(data) if args.kind == "auto" else args.kind
        if kind == "preference" and args.max_new_tokens != ANSWER_TOKENS:
            return _fail(f"--max-new-tokens {args.max_new_tokens} has no effect on preference rows ({data} is scored "
                         f"by the log-probability of its chosen and rejected answers, nothing is generated); drop it")
        if kind == "preference" and args.batch_size is not None:
            return _fail(f"--batch-size {args.batch_size} has no effect on preference rows ({data} is scored row by "
                         f"row, nothing is generated); drop it")
        if kind in ("sft", "prompts"):
            context = _context_of(base_dir or model_dir)
            if context is not None and args.max_new_tokens >= context:
                return _fail(f"--max-new-tokens {args.max_new_tokens} does not fit the model's context "
                             f"(max_position_embeddings={context} in {(base_dir or model_dir) / 'config.json'}, prompt "
                             f"included); give --max-new-tokens {context - 1} or less")
            sft_rows = scoring_rows("prompts", data, args.limit) if kind == "prompts" else \
                scoring_rows("sft", data, args.limit)
            model, tokenizer_dir = load_scoring_model(args.model, args.base)
            em = exact_match(model, tokenizer_dir, sft_rows, max_new_tokens=args.max_new_tokens,
                             batch_size=SFT_BATCH if args.batch_size is None else args.batch_size)
            result = {"kind": kind, "rows": em.total, "exact_match": round(em.score, 4), "too_long": em.too_long,
                      "capped": em.capped}
            lines = [f"exact match {em.correct}/{em.total} = {em.score:.1%}"]
            if em.too_long:
                lines.append(f"  {em.too_long} row(s) have a prompt that fills the model's context: scored as wrong")
            if em.capped:
                lines.append(f"  {em.capped} row(s) have less room than --max-new-tokens {args.max_new_tokens} left "
                             f"in the model's context: their answers were cut to it")
            lines += [f"  Q: {q!r}  reference {r!r}  answer {a!r}" for q, r, a in em.examples]
        else:
            preference_rows = scoring_rows("preference", data, args.limit)
            model, tokenizer_dir = load_scoring_model(args.model, args.base)
            pa = preference_accuracy(model, tokenizer_dir, preference_rows)
            result = {"kind": kind, "rows": pa.total, "preference_accuracy": round(pa.score, 4),
                      "mean_margin": round(pa.mean_margin, 4)}
            lines = [f"preference accuracy {pa.correct}/{pa.total} = {pa.score:.1%}, mean log-prob margin "
                     f"(chosen - rejected) {pa.mean_margin:+.3f} nats"]
    except (ValueError, OSError) as e:  # DataError, model config errors, missing files: one line
        return _fail(str(e))
    except SafetensorError as e:  # a weights file the config checks could not see damaged
        return _fail(f"{args.model}: a weights file is truncated or corrupt ({e}); copy or convert it again")
    print(json.dumps(result) if args.json else "\n".join(lines))
    return 0
