"""``plait generate``: sample text from a trained run or a Hugging Face model directory (one process).

A run directory holds ``final/`` (the Hugging Face directory the trainer writes at the end, or
wherever its ``recipe.yaml`` puts ``checkpoint.dir``) and ``tokenizer.json``; a Hugging Face
directory holds ``config.json``, ``*.safetensors`` and ``tokenizer.json``. Problems with the inputs
(a device this build lacks, a truncated weights file, a run without a final checkpoint) are
reported on one line with exit status 2, before the model is built where they can be: so is a
prompt plus ``--max-new-tokens`` longer than the model's context (``max_position_embeddings``),
which the model could not attend over (without the option, the default shrinks to what fits).
The text streams to stdout as the tokens come (the KV-cache engine, :mod:`plait.inference`);
``--no-stream`` prints it once at the end.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

EOS_TOKEN = "<|endoftext|>"
#: new tokens when --max-new-tokens is not given (fewer when the model's context has less room)
DEFAULT_NEW_TOKENS = 100


@runtime_checkable
class TokenConfig(Protocol):
    """What generation reads from a model's config (every family's config has these fields)."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | list[int] | None


class _UsageError(Exception):
    """An input problem reported as ``plait generate: <message>`` with exit status 2."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="sample text from a trained run or a Hugging Face model",
                              description="Sample text from a trained run (--run) or a Hugging Face "
                                          "model directory (--hf), in one process.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", metavar="RUN_DIR", help="run directory with final/ and tokenizer.json")
    src.add_argument("--hf", metavar="HF_DIR", help="Hugging Face directory (config.json, *.safetensors, "
                                                     "tokenizer.json) or a packaged model's name, e.g. "
                                                     "smollm2-135m-instruct")
    p.add_argument("--prompt", default="", metavar="TEXT", help="text to continue (default: start of a new document)")
    p.add_argument("--chat", action="store_true",
                   help="treat --prompt as a user message: render it with the model's chat template (its "
                        "tokenizer_config.json or chat_template.jinja; ChatML otherwise) and print the answer")
    p.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message first")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help=f"tokens to add (default {DEFAULT_NEW_TOKENS}, or what fits in the model's context: "
                        f"the prompt and the new tokens together are at most its max_position_embeddings)")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K most likely (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample among the smallest set of tokens with probability >= P (1 = all)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T", help="softmax temperature (default 1)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (default 0)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the text before the first occurrence of TEXT (repeat for several)")
    p.add_argument("--device", default="cpu", help="torch device to run on (default cpu)")
    p.add_argument("--no-stream", "--no-progress", action="store_true", dest="no_stream",
                   help="print the text once at the end instead of as the tokens come")
    p.set_defaults(func=run)
    return p


def _check_args(args: argparse.Namespace) -> None:
    if args.system is not None and not args.chat:
        raise _UsageError("--system needs --chat: a system message is part of a chat conversation (plain "
                          "generation continues --prompt as text); add --chat, or put the text in --prompt")
    for option, text in (("--prompt", args.prompt), ("--system", args.system)):
        try:
            (text or "").encode("utf-8")
        except UnicodeEncodeError as e:  # bytes of the command line that are not UTF-8 (kept as surrogates)
            raise _UsageError(f"{option} holds bytes that are not UTF-8 text (at character {e.start}); pass UTF-8 "
                              f"text") from None
    if args.greedy:
        ignored = [f"{option}={value}" for option, value, default in (
            ("--top-k", args.top_k, 0), ("--top-p", args.top_p, 1.0), ("--temperature", args.temperature, 1.0))
            if value != default]
        if ignored:
            raise _UsageError(f"{', '.join(ignored)} has no effect with --greedy (the most likely token is always "
                              f"taken); drop --greedy to sample, or drop {ignored[0].split('=')[0]}")
    empty = [i for i, text in enumerate(args.stop) if not text]
    if empty:
        raise _UsageError("--stop '' would end the text before it starts; give a non-empty TEXT")
    if args.max_new_tokens is not None and args.max_new_tokens < 0:
        raise _UsageError(f"--max-new-tokens={args.max_new_tokens} must be >= 0")
    if args.top_k < 0:
        raise _UsageError(f"--top-k={args.top_k} must be >= 0 (0 disables top-k)")
    if not 0 < args.top_p <= 1:
        raise _UsageError(f"--top-p={args.top_p} must be in (0, 1]")
    for option, value in (("--temperature", args.temperature), ("--top-p", args.top_p)):
        if not math.isfinite(value):
            raise _UsageError(f"{option}={value} must be a finite number")
    if not args.greedy and not args.temperature > 0:
        raise _UsageError(f"--temperature={args.temperature} must be > 0 (use --greedy for argmax decoding)")
    _check_device(args.device)


def _check_device(name: str) -> None:
    """A device this torch build cannot use here fails now, not as a traceback from the model build."""
    from plait.devices import DeviceError, usable_torch_device

    try:
        usable_torch_device(name)
    except DeviceError as e:
        raise _UsageError(f"--device: {e}") from None


def _adapter_base(path: Path) -> Path | None:
    """The base model directory when ``path`` is a LoRA adapter (a LoRA run's final/), else None."""
    from plait.data.errors import DataError
    from plait.heldout import ADAPTER_CONFIG, adapter_base

    if not (path / ADAPTER_CONFIG).is_file():
        return None
    try:
        return adapter_base(path)
    except (DataError, OSError, ValueError) as e:
        raise _UsageError(f"LoRA adapter {path}: {_one_line(e)}") from None


def _check_model_dir(path: Path, what: str) -> None:
    base = _adapter_base(path) if path.is_dir() else None
    if base is not None:  # an adapter: generated from its base with the adapter applied
        _check_model_dir(base, f"the base of the LoRA adapter {path}:")
        return
    if path.exists() and not path.is_dir():
        raise _UsageError(f"{what} {path} is a file, not a directory; give the directory that holds config.json, "
                          f"*.safetensors and tokenizer.json")
    if not (path / "config.json").is_file():
        raise _UsageError(f"{what} {path} has no config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise _UsageError(f"{what} {path} has no *.safetensors weights")
    for file in files:
        _check_weights_file(file)


def _check_weights_file(file: Path) -> None:
    """Open a safetensors file's header, which covers the whole file: a truncated or damaged file
    is named here instead of failing as a traceback inside the loader."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise _UsageError(f"weights file {file} is truncated or corrupt ({reason}); copy or convert it again") from None


@dataclass(frozen=True)
class RunCheckpoints:
    """Where a run's recipe says its checkpoints go (the defaults when it has no readable recipe)."""

    save_final: bool | None  # None: recipe.yaml missing or unreadable
    final_dir: Path
    save_dir: Path


def run_checkpoints(run_dir: Path) -> RunCheckpoints:
    """``checkpoint.save_final``, ``checkpoint.dir`` and ``checkpoint.save_dir`` of the run's
    ``recipe.yaml`` (the resolved recipe the trainer writes), falling back to ``final/`` and
    ``checkpoints/`` inside the run. Read loosely: a damaged recipe only loses the hint."""
    import yaml

    default = RunCheckpoints(None, run_dir / "final", run_dir / "checkpoints")
    try:
        section = (yaml.safe_load((run_dir / "recipe.yaml").read_text(encoding="utf-8")) or {}).get("checkpoint")
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        return default
    if not isinstance(section, dict):
        return default
    save_final = section.get("save_final")

    def where(key: str, fallback: Path) -> Path:
        value = section.get(key)
        return Path(value) if isinstance(value, str) and value and "{" not in value else fallback

    return RunCheckpoints(save_final if isinstance(save_final, bool) else None,
                          where("dir", default.final_dir), where("save_dir", default.save_dir))


def _no_final_message(run_dir: Path, facts: RunCheckpoints) -> str:
    """Why the run has no final checkpoint, and how to get a model out of its training checkpoints."""
    from plait.checkpoint.store import latest_checkpoint

    where = "final/" if facts.final_dir == run_dir / "final" else f"final checkpoint ({facts.final_dir})"
    if facts.save_final is False:
        why = f"run directory {run_dir} has no {where}: it was trained with checkpoint.save_final=false"
    else:
        why = f"run directory {run_dir} has no {where} (written when training ends; did it finish?)"
    save_dir = facts.save_dir if facts.save_dir.is_dir() else run_dir / "checkpoints"
    latest = latest_checkpoint(save_dir)
    if latest is None:
        return f"{why}, and {save_dir} holds no complete training checkpoint to convert"
    return (f"{why}; convert its newest training checkpoint ({latest.name}) with "
            f"`plait convert {save_dir} DIR`, then run `plait generate --hf DIR`")


def _run_model_dir(run_dir: Path) -> Path:
    """The run's final Hugging Face directory: ``final/``, or the recipe's ``checkpoint.dir``."""
    facts = run_checkpoints(run_dir)
    for model_dir in (run_dir / "final", facts.final_dir):
        if model_dir.is_dir():
            return model_dir
    raise _UsageError(_no_final_message(run_dir, facts))


def resolve_paths(args: argparse.Namespace) -> tuple[Path, Path]:
    """``(model_dir, tokenizer_file)`` for ``--run`` or ``--hf``, or a :class:`_UsageError`."""
    if args.run is not None:
        run_dir = Path(args.run)
        if run_dir.exists() and not run_dir.is_dir():
            raise _UsageError(f"run directory {run_dir} is a file, not a directory; give the run's output "
                              f"directory (run.output_dir), which holds final/ and tokenizer.json")
        if not run_dir.is_dir():
            raise _UsageError(f"run directory {run_dir} does not exist")
        model_dir = _run_model_dir(run_dir)
        _check_model_dir(model_dir, "checkpoint")
        for tok in (run_dir / "tokenizer.json", model_dir / "tokenizer.json"):
            if tok.is_file():
                return model_dir, tok
        raise _UsageError(f"run directory {run_dir} has no tokenizer.json")
    from plait.models.packaged import PackagedModelError, model_directory  # commands import lazily (fast --help)

    try:
        model_dir = model_directory(args.hf)  # a packaged model's name (smollm2-135m-instruct) or a directory
    except PackagedModelError as e:
        raise _UsageError(str(e)) from None
    if model_dir.exists() and not model_dir.is_dir():
        raise _UsageError(f"Hugging Face directory {model_dir} is a file, not a directory; give the directory "
                          f"that holds config.json, *.safetensors and tokenizer.json")
    if not model_dir.is_dir():
        raise _UsageError(f"Hugging Face directory {model_dir} does not exist")
    _check_model_dir(model_dir, "Hugging Face directory")
    tok = model_dir / "tokenizer.json"
    if not tok.is_file():
        raise _UsageError(f"Hugging Face directory {model_dir} has no tokenizer.json")
    return model_dir, tok


def _special_ids(tokenizer) -> set[int]:
    return {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}


def start_and_stop_ids(tokenizer, config: TokenConfig) -> tuple[int | None, set[int]]:
    """The token that starts an empty prompt, and the ids that end generation.

    plait's tokenizers end every document with ``<|endoftext|>``, so that token both starts a new
    document and stops one; otherwise the config's ``bos_token_id`` starts. The config's
    ``eos_token_id`` stops only when it is a special token of the tokenizer (a plait run that
    kept the default ``eos_token_id=2`` would otherwise stop on an ordinary byte).
    """
    special = _special_ids(tokenizer)
    eot = tokenizer.token_to_id(EOS_TOKEN)
    eos = config.eos_token_id
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    stop = {i for i in eos_ids if i in special}
    if eot is not None:
        stop.add(eot)
    start = eot
    if start is None and config.bos_token_id is not None and 0 <= config.bos_token_id < config.vocab_size:
        start = config.bos_token_id
    return start, stop


def run(args: argparse.Namespace) -> int:
    try:
        _check_args(args)
        model_dir, tok_file = resolve_paths(args)
        return _generate(args, model_dir, tok_file)
    except _UsageError as e:
        print(f"plait generate: {e}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace, model_dir: Path, tok_file: Path) -> int:
    from tokenizers import Tokenizer

    from plait.heldout import load_scoring_model
    from plait.inference import Sampling, StopRules, generate_tokens
    from plait.inference.streaming import TextStream
    from plait.materialize import build_model
    from plait.mesh import single_process_mesh
    from plait.models.decoder.config import DecoderConfig
    from plait.models.errors import ModelConfigError
    from plait.models.hf_io import CheckpointMismatchError, load_hf_config

    try:
        tokenizer = Tokenizer.from_file(str(tok_file))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception
        raise _UsageError(f"cannot read tokenizer {tok_file}: {str(e).splitlines()[0] if str(e) else e!r}") from None
    from safetensors import SafetensorError

    base = _adapter_base(model_dir)
    try:
        config = load_hf_config(base or model_dir)  # config.json only: the prompt is checked before the weights load
    except (ModelConfigError, OSError) as e:
        raise _UsageError(f"cannot load {model_dir}: {_one_line(e)}") from None
    assert isinstance(config, DecoderConfig), f"model config {type(config).__name__} is not a model family's"
    start, stop = start_and_stop_ids(tokenizer, config)
    shown = args.prompt
    if args.chat:
        text, chat_stop = _chat_prompt(args, tok_file, tokenizer)
        stop |= chat_stop
        ids, shown = tokenizer.encode(text, add_special_tokens=False).ids, ""
    else:
        ids = tokenizer.encode(args.prompt).ids if args.prompt else []
    if not ids:
        if start is None:
            raise _UsageError("the prompt is empty and the model has no start token; give --prompt TEXT")
        ids = [start]
    too_big = [i for i in ids if i >= config.vocab_size]
    if too_big:
        raise _UsageError(f"the tokenizer produced id {too_big[0]} but the model's vocab_size is "
                          f"{config.vocab_size}; the tokenizer does not belong to this model")
    args.max_new_tokens = new_token_count(args.max_new_tokens, len(ids),
                                          getattr(config, "max_position_embeddings", None), model_dir)
    try:
        if base is not None:  # the base with the adapter applied, as plait eval scores it
            model = load_scoring_model(model_dir)[0].to(args.device)
        else:
            model = build_model(config, single_process_mesh(), device=args.device, hf_path=model_dir)  # any family
    except (ModelConfigError, CheckpointMismatchError, FileNotFoundError) as e:
        raise _UsageError(f"cannot load {model_dir}: {e}") from None
    except SafetensorError as e:  # a file the directory's index names, damaged (the others were checked)
        raise _UsageError(f"cannot load {model_dir}: a weights file is truncated or corrupt ({e})") from None
    def decode(tokens: list[int]) -> str:
        return tokenizer.decode([t for t in tokens if t not in stop], skip_special_tokens=True)

    sampling = Sampling(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    rules = StopRules(eos_ids=frozenset(stop), stop_strings=tuple(args.stop), decode=decode)
    sys.stdout.write(shown)
    stream = None if args.no_stream else TextStream(decode, sys.stdout, strip=args.chat, stop_strings=args.stop)
    done = generate_tokens(model, [ids], args.max_new_tokens, sampling=sampling, seeds=[args.seed], stop=rules,
                           on_token=None if stream is None else (lambda _row, token: stream.add(token)))[0]
    text = done.text if done.text is not None else decode(done.tokens)
    text = text.strip() if args.chat else text
    if stream is None:
        sys.stdout.write(text)
    else:
        stream.close(text)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def new_token_count(asked: int | None, prompt_tokens: int, context: int | None, model_dir: Path) -> int:
    """The new tokens to generate: ``asked`` (``None``: :data:`DEFAULT_NEW_TOKENS`, or fewer so the
    prompt and the answer fit the model's context). The model never sees more than
    ``max_position_embeddings`` tokens, so a prompt that fills it, or an explicit ``--max-new-tokens``
    beyond the room left, is refused here rather than generated with a forgotten beginning."""
    if not isinstance(context, int) or context < 1:
        return DEFAULT_NEW_TOKENS if asked is None else asked
    where = f"max_position_embeddings={context} in {model_dir / 'config.json'}"
    room = context - prompt_tokens
    if room < 1:
        raise _UsageError(f"the prompt is {prompt_tokens} tokens, which leaves no room for new tokens in the "
                          f"model's context ({where}); give a prompt of at most {context - 1} tokens")
    if asked is None:
        return min(DEFAULT_NEW_TOKENS, room)
    if asked > room:
        raise _UsageError(f"--max-new-tokens={asked} does not fit the model's context: the prompt is "
                          f"{prompt_tokens} tokens and {where}, so at most {room} new tokens; give "
                          f"--max-new-tokens {room} or less")
    return asked


def _chat_prompt(args: argparse.Namespace, tok_file: Path, tokenizer) -> tuple[str, set[int]]:
    """The conversation (optional system message, the user's --prompt) rendered with a generation
    prompt, and the ids that end an assistant turn under that template."""
    from plait.data.chat_template import load_chat_template
    from plait.data.errors import DataError

    if not args.prompt:
        raise _UsageError("--chat needs --prompt TEXT (the user's message)")
    try:
        template = load_chat_template(tok_file, tokenizer)
    except DataError as e:  # the template does not compile, tokenizer_config.json is not JSON, ...
        raise _UsageError(_one_line(e)) from None
    except (OSError, UnicodeDecodeError) as e:  # chat_template.jinja unreadable, or not UTF-8
        where = getattr(e, "filename", None) or tok_file.parent / "chat_template.jinja"
        raise _UsageError(f"chat template {where} cannot be read as UTF-8 text ({_one_line(e)}); fix it, or "
                          f"remove it to use plait's default ChatML template") from None
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.prompt}]
    try:
        text = template.render(messages, add_generation_prompt=True)
    except DataError as e:
        raise _UsageError(_one_line(e)) from None
    ends = {tokenizer.token_to_id(t) for t in (template.eos_token, "<|im_end|>", "<|eot_id|>", "<|endoftext|>") if t}
    return text, {i for i in ends if i is not None}


__all__ = ["DEFAULT_NEW_TOKENS", "RunCheckpoints", "add_parser", "new_token_count", "resolve_paths", "run",
           "run_checkpoints", "start_and_stop_ids"]
