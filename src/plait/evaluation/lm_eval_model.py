"""The ``plait`` model of lm-evaluation-harness: benchmarks scored by plait's own forward.

``PlaitLM`` is registered with lm-eval as ``plait`` (``lm_eval.simple_evaluate(model="plait",
model_args="pretrained=DIR")`` works once this module is imported), and ``plait eval MODEL
--lm-eval TASK`` builds one. It holds a plait model (one process, or this rank's shard of a
tensor-parallel model) and the model directory's Hugging Face tokenizer, and answers lm-eval's
three requests:

- ``loglikelihood``: (log-probability, is-greedy) of each continuation after its context;
- ``loglikelihood_rolling``: the log-likelihood of each whole document, in windows of the
  model's length (:func:`plait.evaluation.scoring.rolling_windows`);
- ``generate_until``: text from the KV-cache engine (:func:`plait.inference.generate_tokens`),
  ended at the request's ``until`` strings, the end-of-text token or ``max_gen_toks``.

Tokenization is lm-eval's Hugging Face backend's, on the same tokenizer (the context's trailing
spaces move to the continuation, the continuation's tokens are those of the whole string after the
context's, an empty context becomes the start-of-text token, a long request loses its oldest
tokens), so the scores of ``plait`` and ``hf`` differ only by what the two models compute.

Under tensor parallelism every rank of the group evaluates every request (lm-eval sees one
process, ``rank`` 0 of ``world_size`` 1, on each of them): the forward and the engine are
collective, the ranks compute the same scores and pick the same tokens.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.instance import Instance  # type: ignore[import-untyped]
from lm_eval.api.model import TemplateLM  # type: ignore[import-untyped]
from lm_eval.api.registry import register_model  # type: ignore[import-untyped]
from lm_eval.models.utils import (  # type: ignore[import-untyped]
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from torch import nn

from plait.evaluation.errors import LmEvalError
from plait.evaluation.scoring import ScoreRequest, score_continuations, score_documents
from plait.heldout import scoring_model_dir
from plait.inference import Sampling, StopRules, generate_tokens, model_context
from plait.lora import apply_lora, load_peft_adapter, read_peft_settings
from plait.materialize import load_from_hf
from plait.mesh import ParallelMesh, single_process_mesh
from plait.models.family import config_of
from plait.quantize import cast_base_, quantize_as_recorded, read_base_quantization

#: new tokens of a generation request that names no ``max_gen_toks`` (lm-eval's own default)
DEFAULT_GEN_TOKENS = 256
#: generation keywords the engine understands; any other one is refused rather than ignored,
#: since ignoring it would change the score without saying so
GEN_KWARGS = frozenset({"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p", "seed"})

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_eval_model(directory: str | os.PathLike, *, base: str | os.PathLike | None = None,
                    mesh: ParallelMesh | None = None, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> tuple[nn.Module, Path]:
    """``(this rank's model, tokenizer directory)`` of a Hugging Face directory (a packaged model's
    name resolves to it) or of a PEFT adapter directory on its base, on ``mesh`` (default: one
    process). The paths are checked first (:func:`plait.heldout.scoring_model_dir`)."""
    mesh = mesh or single_process_mesh()
    path, base_path, tokenizer_dir = scoring_model_dir(directory, base, need_tokenizer=True)
    if base_path is None:
        return load_from_hf(path, mesh, dtype=dtype, device=device), tokenizer_dir
    quantized = read_base_quantization(path) is not None
    # a QLoRA base is quantized from its fp32 values (rounded as recorded), then cast to ``dtype``
    model = load_from_hf(base_path, mesh, dtype=torch.float32 if quantized else dtype, device=device)
    apply_lora([model], read_peft_settings(path), seed=0)
    load_peft_adapter([model], path)
    if quantized:
        quantize_as_recorded([model], path)  # a QLoRA adapter runs on the base it was trained on
        cast_base_([model], dtype)
    return model, tokenizer_dir


def _hf_tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@register_model("plait")
class PlaitLM(TemplateLM):
    """lm-eval's view of a plait model.

    Give ``pretrained`` (a model directory, as lm-eval's ``model_args`` do) or an already built
    ``model`` with its ``tokenizer_dir``; ``mesh`` places it (tensor parallelism: every rank of
    the group constructs one with the same arguments). ``batch_size``: requests per forward (or
    prompts decoded together); ``max_length``: the longest input (default the model's
    ``max_position_embeddings``)."""

    def __init__(self, pretrained: str | os.PathLike | None = None, *, model: nn.Module | None = None,
                 tokenizer_dir: str | os.PathLike | None = None, base: str | os.PathLike | None = None,
                 mesh: ParallelMesh | None = None, batch_size: int | str = 8, max_length: int | str | None = None,
                 dtype: str = "float32", device: str = "cpu", seed: int | str = 0, **unused: Any) -> None:
        super().__init__()
        if unused:
            raise LmEvalError(f"model argument(s) {', '.join(sorted(unused))} are not options of the plait model; "
                              f"valid: pretrained, base, batch_size, max_length, dtype, device, seed")
        if dtype not in _DTYPES:
            raise LmEvalError(f"dtype={dtype!r} is not valid; choose one of {sorted(_DTYPES)}")
        if (pretrained is None) == (model is None):
            raise LmEvalError("give exactly one of pretrained (a model directory) and model (a built plait model)")
        if model is None:
            assert pretrained is not None
            model, found = load_eval_model(pretrained, base=base, mesh=mesh, dtype=_DTYPES[dtype], device=device)
            tokenizer_dir = tokenizer_dir or found
        elif tokenizer_dir is None:
            raise LmEvalError("a built model needs tokenizer_dir: the directory of its tokenizer.json")
        self.model = model
        self.tokenizer = _hf_tokenizer(Path(tokenizer_dir))
        if not str(batch_size).isdigit() or int(batch_size) < 1:
            raise LmEvalError(f"batch_size={batch_size!r} must be a whole number of at least 1 (the plait model "
                              f"does not search for one: 'auto' is not supported)")
        self._batch_size = int(batch_size)
        context = model_context(model)
        self._max_length = int(max_length) if max_length is not None else context
        if self._max_length is None or self._max_length < 1:
            raise LmEvalError("the model's config has no max_position_embeddings; give max_length")
        self._seed = int(seed)
        self._device = next(model.parameters()).device

    # ------------------------------------------------------------------ what lm-eval reads
    @property
    def eot_token_id(self) -> int:
        """The tokenizer's end-of-text id, else the model config's first ``eos_token_id``."""
        if self.tokenizer.eos_token_id is not None:
            return int(self.tokenizer.eos_token_id)
        eos = config_of(self.model).eos_token_id
        ids = eos if isinstance(eos, list) else [eos]
        if not ids or ids[0] is None:
            raise LmEvalError("neither the tokenizer nor config.json names an end-of-text token (eos_token / "
                              "eos_token_id); lm-eval needs one to start empty contexts and end generations")
        return int(ids[0])

    @property
    def prefix_token_id(self) -> int:
        """What an empty context becomes: the start-of-text token, else the end-of-text one."""
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        assert self._max_length is not None
        return self._max_length

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def max_gen_toks(self) -> int:
        return DEFAULT_GEN_TOKENS

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The tokenizer's ids of ``string``, its special tokens as lm-eval's Hugging Face backend
        adds them (the tokenizer's default, none when the string starts with the prefix token)."""
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            options = {"add_special_tokens": False}
        return list(self.tokenizer.encode(string, **options))

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return str(self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt))

    # ------------------------------------------------------------------ the three requests
    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        scores = score_continuations(self.model, [ScoreRequest(ctx, cont) for _, ctx, cont in requests],
                                     max_length=self.max_length, batch_size=self.batch_size)
        out = [(s.logprob, s.is_greedy) for s in scores]
        for (strings, _, _), answer in zip(requests, out, strict=True):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, answer)
        return out

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        documents = [self.tok_encode(string) for (string,) in (r.args for r in requests)]
        totals = score_documents(self.model, documents, prefix_token=self.prefix_token_id,
                                 max_length=self.max_length, batch_size=self.batch_size)
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with ``do_sample``) text per request, cut before the first of its
        ``until`` strings; requests with the same keywords are decoded ``batch_size`` at a time."""
        groups: dict[str, list[int]] = defaultdict(list)
        for i, request in enumerate(requests):
            groups[json.dumps(request.args[1], sort_keys=True, default=str)].append(i)
        out: list[str] = [""] * len(requests)
        for members in groups.values():
            gen_kwargs = requests[members[0]].args[1]
            for i, text in zip(members, self._generate([requests[i].args[0] for i in members], gen_kwargs),
                               strict=True):
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    def _generate(self, contexts: list[str], gen_kwargs: dict[str, Any]) -> list[str]:
        unknown = sorted(set(gen_kwargs) - GEN_KWARGS - {"max_new_tokens", "max_tokens", "max_completion_tokens"})
        if unknown:
            raise LmEvalError(f"generation_kwargs {unknown} are not supported by the plait model (it understands "
                              f"{sorted(GEN_KWARGS)}); drop them from the task")
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
        budget = int(kwargs.pop("max_gen_toks"))
        room = self.max_length - budget
        if room < 1:
            raise LmEvalError(f"max_gen_toks={budget} leaves no room for a prompt in the model's length "
                              f"({self.max_length}); ask for fewer new tokens")
        sampling = Sampling(greedy=True)
        if kwargs.get("do_sample"):
            sampling = Sampling(temperature=float(kwargs.get("temperature") or 1.0), top_k=int(kwargs.get("top_k", 0)),
                                top_p=float(kwargs.get("top_p", 1.0)))
        seed = int(kwargs.get("seed", self._seed))
        config_eos = config_of(self.model).eos_token_id
        eos_ids = {self.eot_token_id, *(config_eos if isinstance(config_eos, list) else
                                         [] if config_eos is None else [config_eos])}
        stop = StopRules(eos_ids=frozenset(int(i) for i in eos_ids),
                         stop_strings=tuple(s for s in until if s and s != eos_text), decode=self.tok_decode)
        prompts = [self.tok_encode(c)[-room:] for c in contexts]
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        texts = [""] * len(prompts)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            done = generate_tokens(self.model, [prompts[i] for i in batch], budget, sampling=sampling,
                                   seeds=[seed + i for i in batch], stop=stop)
            for i, completion in zip(batch, done, strict=True):
                texts[i] = postprocess_generated_text(self.tok_decode(completion.tokens), until, None)
        return texts


__all__ = ["DEFAULT_GEN_TOKENS", "PlaitLM", "load_eval_model"]
