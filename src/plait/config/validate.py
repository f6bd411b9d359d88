"""Validation of a recipe: every problem at once, one line each, before anything starts.

:func:`validate_recipe` is pure: it reads at most a Hugging Face ``config.json``, checks that
the data source exists and is of a readable kind, loads a tokenizer file, and estimates the model
state against this host's memory; it creates no directory, process or process group. Problems
are reported as ``<field.path>: <value> — <what is valid>``; type errors found by pydantic are
converted to the same form. When some fields have type errors, the rules between fields still
run on the rest of the recipe, skipping the rules that involve a broken field, so one pass
reports everything.
"""

from __future__ import annotations

import codecs
import difflib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from plait.config.schema import ARCH_FIELDS, SECTIONS, Recipe, read_hf_config
from plait.data.prepare import prepared_source
from plait.models.llama.config import LlamaConfig, ModelConfigError, rope_scaling_problems


@dataclass(frozen=True)
class Problem:
    """One invalid setting: the field's dotted path, its value and what would be valid."""

    field: str
    value: Any
    valid: str

    def __str__(self) -> str:
        return f"{self.field}: {format_value(self.value)} — {self.valid}"


class RecipeError(ValueError):
    """An invalid recipe. ``problems`` lists every problem; the message has one line per problem."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems: list[Problem] = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))

    @property
    def fields(self) -> list[str]:
        return [p.field for p in self.problems]


class Verbatim(str):
    """A problem value printed as is (not quoted)."""


def format_value(value: Any, limit: int = 80) -> str:
    """A value as written in a recipe: ``null``, ``true``, numbers plain, strings quoted."""
    if isinstance(value, Verbatim):
        return str(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ---------------------------------------------------------------------- pydantic errors
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _suggest(name: str, choices: Iterable[str]) -> str | None:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def _field_default(section: str, name: str) -> tuple[bool, Any]:
    cls = SECTIONS.get(section)
    info = cls.model_fields.get(name) if cls is not None else None
    return (info is not None, None if info is None else info.default)


def _type_text(err: dict[str, Any]) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    texts = {
        "int_type": "must be an integer", "int_parsing": "must be an integer",
        "int_from_float": "must be an integer", "float_type": "must be a number",
        "float_parsing": "must be a number", "finite_number": "must be a finite number",
        "bool_type": "must be true or false (write true or false; yes/no/on/off are text)",
        "bool_parsing": "must be true or false (write true or false; yes/no/on/off are text)",
        "string_type": "must be a string", "string_too_short": "must not be empty",
        "dict_type": "must be a mapping", "model_type": "must be a mapping of fields",
        "model_attributes_type": "must be a mapping of fields",
    }
    if kind in texts:
        return texts[kind]
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        key = {"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt", "less_than_equal": "le"}[kind]
        return f"must be {bounds[kind]} {ctx.get(key)}"
    return err.get("msg", kind)


def problems_from_validation_error(error: ValidationError) -> tuple[list[Problem], set[str]]:
    """``(problems, broken)``: one :class:`Problem` per pydantic error, and the dotted paths of the
    fields whose value is unusable (for a typo'd key: the field it most likely meant)."""
    problems, broken = [], set()
    for err in error.errors():
        loc = [str(x) for x in err["loc"]]
        path = ".".join(loc)
        value = err.get("input")
        if err["type"] == "extra_forbidden" and len(loc) == 1:
            guess = _suggest(loc[0], SECTIONS)
            hint = f"did you mean '{guess}'? " if guess else ""
            problems.append(Problem(path, value, f"unknown section; {hint}valid sections: {', '.join(SECTIONS)}"))
            if guess:
                broken.add(guess)
            continue
        if err["type"] == "extra_forbidden" and len(loc) == 2 and loc[0] in SECTIONS:
            names = list(SECTIONS[loc[0]].model_fields)
            guess = _suggest(loc[1], names)
            hint = f"did you mean '{guess}'? " if guess else ""
            problems.append(Problem(path, value, f"unknown field of {loc[0]}; {hint}valid: {', '.join(names)}"))
            if guess:
                broken.add(f"{loc[0]}.{guess}")
            continue
        text = _type_text(err)
        if len(loc) == 2:
            known, default = _field_default(*loc)
            if known and default is None and err["type"] != "literal_error":
                text += " or null"
        problems.append(Problem(path, value, text))
        broken.add(".".join(loc[:2]))
    return problems, broken


def _drop(data: dict[str, Any], paths: Iterable[str]) -> dict[str, Any]:
    """A copy of ``data`` without the given section/field paths (so they take their defaults)."""
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()}
    for path in paths:
        parts = path.split(".")
        if len(parts) == 1:
            out.pop(parts[0], None)
        elif isinstance(out.get(parts[0]), dict):
            out[parts[0]].pop(parts[1], None)
    return out


def parse_recipe_partial(data: Mapping[str, Any]) -> tuple[Recipe | None, list[Problem], set[str]]:
    """Parse raw recipe data; on type errors also return the recipe with the bad fields at their
    defaults (``None`` if even that fails) and the set of broken field paths."""
    try:
        return Recipe.model_validate(dict(data)), [], set()
    except ValidationError as e:
        problems, broken = problems_from_validation_error(e)
        bad = {".".join(str(x) for x in err["loc"][:2]) for err in e.errors()}
    try:
        return Recipe.model_validate(_drop(dict(data), bad)), problems, broken
    except (ValidationError, TypeError, ValueError):
        return None, problems, broken


# ---------------------------------------------------------------------- the rules
class _Checker:
    def __init__(self, recipe: Recipe, broken: set[str]) -> None:
        self.r = recipe
        self.broken = broken
        self.problems: list[Problem] = []
        self.warnings: list[str] = []

    def ok(self, *fields: str) -> bool:
        """True when none of ``fields`` (dotted paths; a section name covers its fields) is broken."""
        return not any(b == f or f.startswith(b + ".") or b.startswith(f + ".") for f in fields for b in self.broken)

    def add(self, field: str, value: Any, valid: str) -> None:
        self.problems.append(Problem(field, value, valid))
        self.broken.add(field)


ARCH_DEPS = tuple(f"model.{f}" for f in ARCH_FIELDS) + ("model.hf_path", "model.family")


def _check_architecture(c: _Checker) -> LlamaConfig | None:
    """The model's architecture (read from ``hf_path`` or built from the recipe); ``None`` when invalid."""
    m = c.r.model
    if not c.ok(*ARCH_DEPS):
        return None
    if m.hf_path is not None:
        try:
            config = read_hf_config(m.hf_path)
        except ModelConfigError as e:
            c.add("model.hf_path", m.hf_path, str(e))
            return None
        bad = False
        family = type(config).family
        if "family" in m.model_fields_set and m.family != family:
            c.add("model.family", m.family, f"model.hf_path's config.json (model_type "
                                            f"{config.to_hf_dict()['model_type']!r}) is a {family!r} model; "
                                            f"remove model.family or set it to {family!r}")
            bad = True
        for name in sorted(m.model_fields_set & set(ARCH_FIELDS)):
            mine, theirs = getattr(m, name), getattr(config, name, None)
            if mine != theirs:
                c.add(f"model.{name}", mine, f"model.hf_path's config.json sets it to {format_value(theirs)}; "
                                             f"remove it from the recipe")
                bad = True
        return None if bad else config

    start = len(c.problems)
    h, heads, kv = m.hidden_size, m.num_attention_heads, m.num_key_value_heads
    head_dim = m.head_dim
    if head_dim is None:
        if h % heads:
            c.add("model.num_attention_heads", heads,
                  f"must divide model.hidden_size={h} (valid: {_divisors(h)}), or set model.head_dim")
        else:
            head_dim = h // heads
    if heads % kv:
        c.add("model.num_key_value_heads", kv,
              f"must divide model.num_attention_heads={heads} (valid: {_divisors(heads)})")
    if head_dim is not None and head_dim % 2:
        where = "" if m.head_dim is not None else " (hidden_size / num_attention_heads)"
        c.add("model.head_dim", head_dim, f"head dimension{where} must be even for rotary embeddings")
    for message in rope_scaling_problems(m.rope_scaling):
        c.add("model.rope_scaling", m.rope_scaling, message)
    if len(c.problems) > start:
        return None
    try:
        return m.to_model_config(m.vocab_size or 1)
    except ModelConfigError as e:  # anything the family's config rejects that the rules above missed
        _add_config_error(c, str(e))
        return None


def _add_config_error(c: _Checker, message: str) -> None:
    """Report a family config's refusal under the field it names (``model.<field>=...``), else
    under ``model``."""
    match = re.match(r"model\.(\w+)=", message)
    if match and match.group(1) in type(c.r.model).model_fields:
        name = match.group(1)
        c.add(f"model.{name}", getattr(c.r.model, name), message.split("=", 1)[1].split(" ", 1)[-1])
    else:
        c.add("model", Verbatim("(architecture)"), message)


def derive_world_and_dp(tp: int, pp: int, dp: int | None, world_size: int | None) -> tuple[int, int]:
    """``(world_size, dp)``: without a world size, ``tp * pp * (dp or 1)`` processes are assumed."""
    if world_size is None:
        return tp * pp * (dp or 1), dp or 1
    return world_size, dp if dp is not None else world_size // (tp * pp)


def _check_layout(c: _Checker, world_size: int | None) -> int | None:
    """Checks the degrees against the world size; returns dp, or ``None`` when it cannot be derived."""
    p = c.r.parallel
    if world_size is not None and (not isinstance(world_size, int) or isinstance(world_size, bool)
                                   or world_size < 1):
        c.add("world_size", world_size, "must be a positive integer (the number of processes)")
        return None
    if not c.ok("parallel.tp", "parallel.pp", "parallel.dp"):
        return None
    tp, pp = p.tp, p.pp
    world, dp = derive_world_and_dp(tp, pp, p.dp, world_size)
    if world % (tp * pp):
        valid = _divisors(world // pp) if world % pp == 0 else []
        hint = f"tp values that do with pp={pp}: {valid}" if valid else f"pp={pp} does not divide it either"
        c.add("parallel.tp", tp, f"tp*pp = {tp}*{pp} = {tp * pp} must divide the world size {world}; {hint}")
        return None
    if p.dp is not None and p.dp * tp * pp != world:
        c.add("parallel.dp", p.dp, f"must equal world size / (tp*pp) = {world}/{tp * pp} = {world // (tp * pp)}; "
                                   f"or null to derive it")
        return None
    return dp


def _check_heads(c: _Checker, arch: LlamaConfig | None) -> None:
    from plait.tensor_parallel.heads import HeadLayout, HeadLayoutError

    p = c.r.parallel
    if arch is None or not c.ok("parallel.tp", "parallel.kv_replication", "parallel.kv_placement"):
        return
    try:
        HeadLayout.plan(arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, p.tp,
                        p.kv_replication, p.kv_placement)
    except HeadLayoutError as e:
        if p.kv_replication is not None and str(e).startswith("kv_replication"):
            c.add("parallel.kv_replication", p.kv_replication, str(e))
        else:
            c.add("parallel.tp", p.tp, str(e))
        return
    if arch.intermediate_size % p.tp:
        valid = [d for d in _divisors(arch.intermediate_size) if d <= arch.num_attention_heads]
        c.add("parallel.tp", p.tp, f"must divide model.intermediate_size={arch.intermediate_size}; "
                                   f"valid tp: {valid}")


def _check_sequence(c: _Checker, arch: LlamaConfig | None) -> None:
    r = c.r
    seq = r.data.seq_len
    if arch is not None and c.ok("data.seq_len") and seq > arch.max_position_embeddings:
        c.add("data.seq_len", seq, f"must be <= model.max_position_embeddings={arch.max_position_embeddings}")
    tp = r.parallel.tp
    if r.parallel.sequence_parallel and c.ok("parallel.tp") and tp == 1:
        c.warnings.append("parallel.sequence_parallel: true — has no effect with tp=1")
    if (r.parallel.sequence_parallel and c.ok("parallel.sequence_parallel", "parallel.tp", "data.seq_len")
            and tp > 1 and seq % tp):
        c.add("parallel.sequence_parallel", True, f"needs data.seq_len={seq} divisible by parallel.tp={tp}; "
                                                  f"use a seq_len that is a multiple of {tp} or turn it off")


def _check_batch(c: _Checker, dp: int | None) -> None:
    d, p = c.r.data, c.r.parallel
    if (dp is None or d.global_batch_size is None
            or not c.ok("data.global_batch_size", "data.micro_batch_size", "parallel.microbatches")):
        return
    expected = d.micro_batch_size * p.microbatches * dp
    if d.global_batch_size != expected:
        c.add("data.global_batch_size", d.global_batch_size,
              f"must equal micro_batch_size*microbatches*dp = {d.micro_batch_size}*{p.microbatches}*{dp} = "
              f"{expected}; or null to derive it")


def _check_schedule(c: _Checker) -> None:
    r = c.r
    if c.ok("scheduler.warmup_steps", "train.steps") and r.scheduler.warmup_steps > r.train.steps:
        c.add("scheduler.warmup_steps", r.scheduler.warmup_steps, f"must be <= train.steps={r.train.steps}")


def _check_pipeline(c: _Checker, arch: LlamaConfig | None) -> None:
    p = c.r.parallel
    if not c.ok("parallel.pp", "parallel.vpp"):
        return
    if p.vpp > 1 and p.pp == 1:
        c.add("parallel.vpp", p.vpp, "virtual pipeline stages need parallel.pp > 1; use vpp=1")
    if p.pp == 1:
        return
    stages = p.pp * p.vpp
    if arch is not None and arch.num_hidden_layers < stages:
        c.add("model.num_hidden_layers", arch.num_hidden_layers,
              f"fewer decoder layers than pipeline stages pp*vpp = {p.pp}*{p.vpp} = {stages}; every stage "
              f"needs at least one layer: lower parallel.pp or parallel.vpp")
    if not c.ok("parallel.schedule", "parallel.microbatches"):
        return
    if p.vpp > 1 and p.schedule != "interleaved-1f1b":
        c.add("parallel.schedule", p.schedule, f"vpp={p.vpp} needs the 'interleaved-1f1b' schedule")
        return
    from plait.pipeline.schedules import ScheduleError, validate_schedule

    try:
        validate_schedule(p.schedule, p.pp, p.microbatches, p.vpp)
    except ScheduleError as e:
        c.add("parallel.microbatches", p.microbatches, str(e))
    if not c.ok("parallel.partition", "parallel.partition_cost", "parallel.pipeline_cuts"):
        return
    if p.partition == "manual" and not p.pipeline_cuts:
        c.add("parallel.pipeline_cuts", p.pipeline_cuts, "partition='manual' needs the layers that start "
                                                          f"stages 1..{stages - 1}, e.g. ['model.layers.4']")
        return
    if p.partition != "manual" and p.pipeline_cuts:
        c.add("parallel.pipeline_cuts", p.pipeline_cuts, "cuts are used only with partition='manual'")
        return
    if arch is not None and arch.num_hidden_layers >= stages and c.ok("data.seq_len"):
        from plait.pipeline.layout import plan_partition
        from plait.pipeline.partition import PartitionError

        try:
            plan_partition(arch, stages, c.r.data.seq_len, method=p.partition, cost=p.partition_cost,
                           cuts=p.pipeline_cuts)
        except PartitionError as e:
            c.add("parallel.pipeline_cuts" if p.pipeline_cuts else "parallel.partition",
                  p.pipeline_cuts or p.partition, str(e))


def _check_zero_and_precision(c: _Checker, dp: int | None) -> None:
    from plait.train.precision import KNOBS, knob_problems, knob_values

    r = c.r
    if c.ok("parallel.zero1") and r.parallel.zero1 and dp == 1:
        c.warnings.append("parallel.zero1: true — has no effect with dp=1 (nothing to shard over); training unsharded")
    if not c.ok("precision"):
        return
    pr = r.precision
    knobs = pr.knobs()
    if pr.preset != "manual":
        fixed = knob_values(pr.preset)
        for name in KNOBS:
            if knobs[name] is not None:
                c.add(f"precision.{name}", knobs[name],
                      f"is a knob of precision.preset 'manual'; the {pr.preset!r} preset fixes it to "
                      f"{format_value(fixed[name])} (remove it, or use preset: manual)")
        return
    for name, message in knob_problems(knob_values("manual", knobs)):
        c.add(f"precision.{name}", knobs[name], message)


def _check_activation_checkpointing(c: _Checker, arch: LlamaConfig | None) -> None:
    t = c.r.train
    if not c.ok("train.activation_checkpointing", "train.checkpoint_modules"):
        return
    if t.activation_checkpointing != "selective":
        if t.checkpoint_modules:
            c.add("train.checkpoint_modules", t.checkpoint_modules,
                  f"is used only with train.activation_checkpointing 'selective' (it is "
                  f"{t.activation_checkpointing!r}); remove it or set selective")
        return
    if not t.checkpoint_modules:
        c.add("train.checkpoint_modules", [], "selective checkpointing needs at least one block submodule name, "
                                              "e.g. ['self_attn'] or ['mlp']")
        return
    if arch is None:
        return
    from plait.activation_checkpointing import checkpointable_names

    valid = checkpointable_names(arch)
    for name in t.checkpoint_modules:
        if name not in valid:
            hint = _suggest(name, valid)
            c.add("train.checkpoint_modules", name, f"is not a submodule of a decoder block"
                                                    f"{f' (did you mean {hint!r}?)' if hint else ''}; valid: "
                                                    f"{', '.join(valid)}")


def _check_paths(c: _Checker) -> None:
    r = c.r
    if c.ok("run.output_dir", "run.name"):
        try:
            out = r.run.output_dir.format(name=r.run.name)
        except (KeyError, IndexError, ValueError, AttributeError):
            c.add("run.output_dir", r.run.output_dir, "only {name} may be substituted; write {{ }} for braces")
            out = None
        for key in ("dir", "save_dir"):
            value = getattr(r.checkpoint, key)
            if c.ok(f"checkpoint.{key}") and out is not None:
                try:
                    value.format(output_dir=out, name=r.run.name)
                except (KeyError, IndexError, ValueError, AttributeError):
                    c.add(f"checkpoint.{key}", value,
                          "only {output_dir} and {name} may be substituted; write {{ }} for braces")
    resume = r.checkpoint.resume
    if c.ok("checkpoint.resume") and resume not in ("none", "auto") and not Path(resume).is_dir():
        c.add("checkpoint.resume", resume, "'none', 'auto', or an existing checkpoint directory (step-N)")


def _text_sniff(path: Path, size: int = 1 << 16) -> str | None:
    """Why the start of ``path`` is not UTF-8 text (``None`` when it is): a binary file renamed
    ``.txt`` would otherwise fail, or train on garbage, only after launch."""
    try:
        with path.open("rb") as f:
            head = f.read(size)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if b"\x00" in head:
        return "holds NUL bytes (a binary file, not text)"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as e:
        return f"is not UTF-8 text (byte {e.start} is invalid)"
    return None


def _check_source(c: _Checker) -> None:
    """``data.source``: a built-in corpus, an existing directory, or a readable .txt/.jsonl file."""
    from plait.data.corpora import CORPORA
    from plait.data.prepare import SOURCE_SUFFIXES

    source = c.r.data.source
    if source in CORPORA:
        return
    path = Path(source).expanduser()
    if not path.exists():
        c.add("data.source", source, f"not a built-in corpus ({', '.join(CORPORA)}) and no such file or directory")
    elif path.is_file():
        kinds = " or ".join(SOURCE_SUFFIXES)
        if path.suffix.lower() not in SOURCE_SUFFIXES:
            what = f"a {path.suffix!r} file" if path.suffix else "a file without a suffix"
            c.add("data.source", source, f"is {what}; a source file must be {kinds} (plain text, or a 'text' field "
                                         f"per JSON line): convert it, or give a directory of such files")
        elif (why := _text_sniff(path)) is not None:
            c.add("data.source", source, f"{why}; a {path.suffix} source must be UTF-8 text")


def _check_tokenizer_file(c: _Checker) -> int | None:
    """``data.tokenizer`` as a file: it must load as a tokenizer and have an end-of-text token
    (what data preparation needs). Returns its vocabulary size (``None`` when it is unusable)."""
    from plait.data.token_shards import TOKENIZER_FILE
    from plait.data.tokenizer import find_eos, load_tokenizer_file, tokenizer_vocab_size

    spec = c.r.data.tokenizer
    path = Path(spec).expanduser()
    if path.is_dir():
        hint = f"; did you mean '{path / TOKENIZER_FILE}'?" if (path / TOKENIZER_FILE).is_file() else ""
        c.add("data.tokenizer", spec, f"must be 'bpe' or a tokenizer.json file, not a directory{hint}")
        return None
    if not path.is_file():
        c.add("data.tokenizer", spec, "must be 'bpe' or the path of an existing tokenizer.json file")
        return None
    try:
        tokenizer = load_tokenizer_file(path)
    except ValueError as e:
        reason = str(e).partition("cannot be loaded ")[2] or str(e)
        c.add("data.tokenizer", spec, f"is not a tokenizer file, tokenizers cannot load it {reason[:160]}; give "
                                      f"a Hugging Face tokenizer.json, or 'bpe' to train one on the source")
        return None
    try:
        find_eos(tokenizer)
    except ValueError as e:
        c.add("data.tokenizer", spec, f"{e}: documents could not be separated; use a tokenizer that has one, "
                                      f"or 'bpe'")
        return None
    return tokenizer_vocab_size(tokenizer)


def _check_vocab_fits(c: _Checker, arch: LlamaConfig | None, tokens: int) -> None:
    """The embedding must have a row for every id the tokenizer file can produce."""
    d, m = c.r.data, c.r.model
    if m.hf_path is not None:
        if arch is not None and tokens > arch.vocab_size:
            c.add("data.tokenizer", d.tokenizer, f"has {tokens} tokens but model.hf_path's config.json has "
                                                 f"vocab_size={arch.vocab_size}; use the checkpoint's own tokenizer")
    elif c.ok("model.vocab_size") and m.vocab_size is not None and m.vocab_size < tokens:
        c.add("model.vocab_size", m.vocab_size, f"must be >= {tokens}, the size of data.tokenizer "
                                                f"'{d.tokenizer}', or null to use the tokenizer's size")


def _check_data(c: _Checker, arch: LlamaConfig | None, check_paths: bool) -> None:
    d, m = c.r.data, c.r.model
    if check_paths and c.ok("data.source"):
        _check_source(c)
    if check_paths and c.ok("data.tokenizer") and d.tokenizer != "bpe":
        tokens = _check_tokenizer_file(c)
        if tokens is not None and c.ok("model.hf_path"):
            _check_vocab_fits(c, arch, tokens)
    if c.ok("data.tokenizer", "model.hf_path") and m.hf_path is not None and d.tokenizer == "bpe":
        c.add("data.tokenizer", "bpe", f"a model initialised from model.hf_path needs its own tokenizer; "
                                       f"set data.tokenizer to '{Path(m.hf_path) / 'tokenizer.json'}'")
    # a prepared source carries its own tokenizer; its size is checked against the model before launch
    if (c.ok("model.vocab_size", "data.vocab_size", "data.tokenizer") and m.hf_path is None
            and d.tokenizer == "bpe" and m.vocab_size is not None and m.vocab_size < d.vocab_size
            and not (c.ok("data.source") and prepared_source(d.source) is not None)):
        c.add("model.vocab_size", m.vocab_size, f"must be >= data.vocab_size={d.vocab_size} (the BPE's size), "
                                                f"or null to use the tokenizer's size")


def collect_problems(recipe: Recipe, world_size: int | None, broken: set[str] | None = None, *,
                     check_paths: bool = True) -> tuple[list[Problem], list[str], LlamaConfig | None]:
    """``(problems, warnings, architecture)`` of the rules between fields, skipping rules that
    involve a field in ``broken`` (those already reported as type errors). ``check_paths=False``
    skips the checks of the files ``data.source`` and ``data.tokenizer`` name (a recipe meant for
    another machine); ``model.hf_path`` is always read, since the rules need its architecture."""
    c = _Checker(recipe, set(broken or ()))
    dp = _check_layout(c, world_size)
    arch = _check_architecture(c)
    _check_heads(c, arch)
    _check_sequence(c, arch)
    _check_batch(c, dp)
    _check_schedule(c)
    _check_pipeline(c, arch)
    _check_zero_and_precision(c, dp)
    _check_activation_checkpointing(c, arch)
    _check_paths(c)
    _check_data(c, arch, check_paths)
    return c.problems, c.warnings, arch


# ---------------------------------------------------------------------- entry points
def validate_recipe(recipe: Recipe | Mapping[str, Any], world_size: int | None = None, *,
                    check_paths: bool = True):
    """Check ``recipe`` for ``world_size`` processes and return its :class:`ResolvedRecipe`.

    ``recipe`` is a :class:`Recipe` or raw recipe data (a mapping, as read from YAML); raw data
    lets type errors and rule violations be reported together. ``world_size=None`` assumes
    ``tp * pp * (dp or 1)`` processes. ``check_paths=False`` (a recipe meant for another machine)
    skips the checks of the files ``data.source`` and ``data.tokenizer`` name and of the model
    state against this host's memory (:mod:`plait.config.host_memory`). Raises
    :class:`RecipeError` listing every problem.
    """
    from plait.config.host_memory import model_state_problem
    from plait.config.resolve import resolve

    broken: set[str] = set()
    problems: list[Problem] = []
    if not isinstance(recipe, Recipe):
        if not isinstance(recipe, Mapping):
            raise RecipeError([Problem("recipe", recipe, "must be a mapping of sections")])
        parsed, problems, broken = parse_recipe_partial(recipe)
        if parsed is None:
            raise RecipeError(problems)
        recipe = parsed
    rule_problems, warnings, arch = collect_problems(recipe, world_size, broken, check_paths=check_paths)
    problems += rule_problems
    if problems:
        raise RecipeError(problems)
    hf_config = arch if recipe.model.hf_path is not None else None
    resolved = resolve(recipe, world_size, hf_config=hf_config, warnings=warnings)
    if check_paths:  # the memory of this host is the limit only for a recipe meant to run here
        problem = model_state_problem(resolved)
        if problem is not None:
            raise RecipeError([problem])
    return resolved


def check_recipe(path: str | None, overrides: Iterable[str] = (), world_size: int | None = None, *,
                 check_paths: bool = True):
    """Load ``path`` (``None`` = the default recipe) with ``overrides`` and validate it, reporting
    type errors and rule violations together. Returns the :class:`ResolvedRecipe`."""
    from plait.config.load import recipe_data

    return validate_recipe(recipe_data(path, list(overrides)), world_size, check_paths=check_paths)
