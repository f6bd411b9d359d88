"""Recipe keys that cannot take effect for this recipe are refused, not ignored.

A field of the schema names the condition under which it does anything with
``json_schema_extra={"applies": NAME}`` (:func:`applies_when`); a whole section may name one for
all its fields in its ``applies`` class attribute. One rule (:func:`inapplicable_fields`) walks the
schema: a field the recipe sets to something other than its default while its condition does not
hold is a problem naming the field, the condition, why it does not hold here and the fix. So a
new knob is covered by one word in the schema, and the docs table can say when each knob
applies.

A written recipe holds every field once it is loaded, so only a value that differs from the
default counts as "set": ``lora.alpha: 16`` with LoRA off is harmless, ``lora.alpha: 32`` is
a mistake (the user expects it to do something).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel
from pydantic.config import JsonDict

from plait.config.problems import Problem
from plait.data.prompt_prepare import prepared_directory
from plait.data.sft_prepare import read_index

#: a condition: ``None`` when it holds for the recipe, else why it does not (the recipe's own values)
Condition = Callable[[Any], str | None]


def _rows(r) -> str | None:
    if r.data.format in ("sft", "preference"):
        return None
    if r.data.format == "prompts":
        return "data.format is 'prompts' (prompt rows are neither packed nor truncated, and a bad row stops)"
    return "data.format is 'text' (plain text has no rows to shape)"


def _text(r) -> str | None:
    return None if r.data.format == "text" else f"data.format is {r.data.format!r} (rows are read in one process)"


def _sft(r) -> str | None:
    return None if r.data.format == "sft" else f"data.format is {r.data.format!r}"


def _lora(r) -> str | None:
    return None if r.lora.rank is not None else "lora.rank is null (LoRA off: every weight trains)"


def _quantized(r) -> str | None:
    if r.lora.rank is None:
        return "lora.rank is null (LoRA off: there is no frozen base to quantize)"
    return None if r.lora.quantized else "lora.quantize_base is 'none' (the base is not quantized)"


def _bpe(r) -> str | None:
    return None if r.data.tokenizer == "bpe" else (f"data.tokenizer is {r.data.tokenizer!r} (a tokenizer file "
                                                   f"has its own vocabulary size)")


def _pipeline(r) -> str | None:
    return None if r.parallel.pp > 1 else "parallel.pp is 1 (one stage: nothing is split)"


def _context_parallel(r) -> str | None:
    return None if r.parallel.cp > 1 else "parallel.cp is 1 (sequences are not split)"


def _tensor_parallel(r) -> str | None:
    return None if r.parallel.tp > 1 else "parallel.tp is 1 (no K/V heads are replicated)"


def _final_model(r) -> str | None:
    return None if r.checkpoint.save_final else "checkpoint.save_final is false (no final model is written)"


def _sample(r) -> str | None:
    return None if r.train.sample_tokens > 0 else "train.sample_tokens is 0 (no sample is generated)"


def _sharded(r) -> str | None:
    level = r.parallel.zero_level()
    return None if level >= 1 else "the ZeRO level is 0 (nothing is sharded)"


def _zero3(r) -> str | None:
    level = r.parallel.zero_level()
    return None if level == 3 else f"the ZeRO level is {level} (the weights are whole on every rank)"


#: condition name -> (when the field applies, in words; the test)
CONDITIONS: dict[str, tuple[str, Condition]] = {
    "zero3": ("parallel.zero is 3", _zero3),
    "sharded": ("parallel.zero is 1 or more", _sharded),
    "rows": ("data.format is 'sft' or 'preference'", _rows),
    "sft": ("data.format is 'sft'", _sft),
    "text": ("data.format is 'text'", _text),
    "lora": ("lora.rank is set", _lora),
    "quantized": ("lora.rank is set and lora.quantize_base is not 'none'", _quantized),
    "bpe": ("data.tokenizer is 'bpe' (a BPE trained on the source)", _bpe),
    "pipeline": ("parallel.pp > 1", _pipeline),
    "context_parallel": ("parallel.cp > 1", _context_parallel),
    "tensor_parallel": ("parallel.tp > 1", _tensor_parallel),
    "final_model": ("checkpoint.save_final is true", _final_model),
    "sample": ("train.sample_tokens > 0", _sample),
}
def applies_when(condition: str | None, *, shapes_rows: bool = False) -> JsonDict:
    """The ``json_schema_extra`` of a field that takes effect only under ``condition`` (``None``:
    always) and, with ``shapes_rows``, that shapes prepared fine-tuning rows (so with an already
    prepared ``data.source`` it must be what the rows were made with)."""
    if condition is not None and condition not in CONDITIONS:
        raise KeyError(f"unknown applicability condition {condition!r}; known: {sorted(CONDITIONS)}")
    extra: JsonDict = {} if condition is None else {"applies": condition}
    if shapes_rows:
        extra["shapes_rows"] = True
    return extra


def _shapes_rows(section: type[BaseModel], name: str) -> bool:
    extra = section.model_fields[name].json_schema_extra
    return isinstance(extra, dict) and extra.get("shapes_rows") is True


def field_condition(section: type[BaseModel], name: str) -> str | None:
    """The condition under which ``section.name`` takes effect (``None``: always)."""
    extra = section.model_fields[name].json_schema_extra
    if isinstance(extra, dict) and isinstance(extra.get("applies"), str):
        return str(extra["applies"])
    found = getattr(section, "applies", None)
    return found if isinstance(found, str) else None


def _changed(section: BaseModel) -> list[str]:
    defaults = type(section)()
    return sorted(n for n in section.model_fields_set if getattr(section, n) != getattr(defaults, n))


def inapplicable_fields(recipe: BaseModel) -> list[Problem]:
    """Every field set to a non-default value whose condition does not hold for ``recipe``; and,
    when ``data.source`` is an already prepared rows (or prompts) directory, every row-shaping
    field set to another value than the rows were made with."""
    problems = []
    data = recipe.data  # type: ignore[attr-defined]
    prepared = prepared_directory(data.format, data.source) if data.format != "text" else None
    index = read_index(prepared) if prepared is not None else None
    for section_name in type(recipe).model_fields:
        section = getattr(recipe, section_name)
        if not isinstance(section, BaseModel):
            continue
        for name in _changed(section):
            condition = field_condition(type(section), name)
            shapes = _shapes_rows(type(section), name)
            value = getattr(section, name)
            field = f"{section_name}.{name}"
            if condition is not None:
                when, test = CONDITIONS[condition]
                why = test(recipe)
                if why is not None:
                    problems.append(Problem(field, value, f"takes effect only when {when}, and {why}; remove it"))
                    continue
            if not shapes or index is None:
                continue
            if index.get(name, value) != value:
                problems.append(Problem(field, value, f"data.source={prepared} holds rows already prepared with "
                                                      f"{name}={index[name]!r}, which this setting cannot change; "
                                                      f"remove it, or prepare the rows again from the .jsonl file"))
            elif name not in index:
                problems.append(Problem(field, value, f"data.source={prepared} holds rows already prepared (their "
                                                      f"{name} is not recorded); this setting cannot change them: "
                                                      f"remove it, or prepare the rows again from the .jsonl file"))
    return problems
