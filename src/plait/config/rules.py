"""The rules between a recipe's fields: layout against world size, heads against TP, batch,
pipeline, precision, activation checkpointing, paths, data source and tokenizer.

Each rule adds :class:`Problem` lines and skips itself when a field it needs is already broken
(reported as a type error), so one pass reports every problem at once.
"""

from __future__ import annotations

import codecs
import re
from pathlib import Path
from typing import Any

from plait.activation_checkpointing import checkpointable_names
from plait.config.applicability import inapplicable_fields
from plait.config.problems import Problem, Verbatim, divisors, format_value, suggest
from plait.config.resolve import derive_world_and_dp
from plait.config.schema import ARCH_FIELDS, PREFERENCE_OBJECTIVES, REFERENCE_OBJECTIVES, Recipe, read_hf_config
from plait.context_parallel.recipe_rules import check_context_parallel, cp_layout_problem
from plait.data.corpora import CORPORA
from plait.data.prepare import SOURCE_SUFFIXES, prepared_source
from plait.data.sft_prepare import rows_directory
from plait.data.token_shards import TOKENIZER_FILE
from plait.data.tokenizer import find_eos, load_tokenizer_file, tokenizer_vocab_size
from plait.lora import PeftAdapterError, read_peft_settings
from plait.lora.apply import projections
from plait.lora.settings import TARGETS
from plait.materialize import build_model
from plait.mesh import single_process_mesh
from plait.models.llama.config import LlamaConfig, ModelConfigError, rope_scaling_problems
from plait.moe import moe_problems
from plait.pipeline.layout import plan_partition
from plait.pipeline.partition import PartitionError
from plait.pipeline.schedules import INTERLEAVED_SCHEDULES, ScheduleError, validate_schedule
from plait.post_training.objectives import PreferenceSettings, PreferenceSettingsError
from plait.precision import KNOBS, knob_problems, knob_values
from plait.tensor_parallel.heads import HeadLayout, HeadLayoutError
from plait.train.compile_rules import compile_problems


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
                  f"must divide model.hidden_size={h} (valid: {divisors(h)}), or set model.head_dim")
        else:
            head_dim = h // heads
    if heads % kv:
        c.add("model.num_key_value_heads", kv,
              f"must divide model.num_attention_heads={heads} (valid: {divisors(heads)})")
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
    cp = p.cp if c.ok("parallel.cp") else 1
    world, dp = derive_world_and_dp(tp, pp, p.dp, world_size, cp)
    if world % (tp * pp):
        valid = divisors(world // pp) if world % pp == 0 else []
        hint = f"tp values that do with pp={pp}: {valid}" if valid else f"pp={pp} does not divide it either"
        c.add("parallel.tp", tp, f"tp*pp = {tp}*{pp} = {tp * pp} must divide the world size {world}; {hint}")
        return None
    if cp_layout_problem(c, world, tp, pp, cp):
        return None
    if p.dp is not None and p.dp * tp * pp * cp != world:
        names, denom = ("tp*pp", tp * pp) if cp == 1 else ("tp*pp*cp", tp * pp * cp)
        c.add("parallel.dp", p.dp, f"must equal world size / ({names}) = {world}/{denom} = {world // denom}; "
                                   f"or null to derive it")
        return None
    return dp


def _check_heads(c: _Checker, arch: LlamaConfig | None) -> None:
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
        valid = [d for d in divisors(arch.intermediate_size) if d <= arch.num_attention_heads]
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
        short = r.train.steps // 10
        c.add("scheduler.warmup_steps", r.scheduler.warmup_steps, f"must be <= train.steps={r.train.steps}; for a "
                                                                  f"short run set scheduler.warmup_steps={short}"
                                                                  + (" (or 0)" if short else ""))


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
    if p.vpp > 1 and p.schedule not in INTERLEAVED_SCHEDULES:
        c.add("parallel.schedule", p.schedule, f"vpp={p.vpp} needs an interleaved schedule ('interleaved-1f1b' or "
                                               f"'interleaved-zb'); {p.schedule!r} supports only parallel.vpp=1")
        return
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
        try:
            plan_partition(arch, stages, c.r.data.seq_len, method=p.partition, cost=p.partition_cost,
                           cuts=p.pipeline_cuts)
        except PartitionError as e:
            c.add("parallel.pipeline_cuts" if p.pipeline_cuts else "parallel.partition",
                  p.pipeline_cuts or p.partition, str(e))


def _check_zero_and_precision(c: _Checker, dp: int | None) -> None:
    r = c.r
    # ZeRO-1 shards over the dp x cp ranks that average gradients
    if c.ok("parallel.zero1") and r.parallel.zero1 and dp == 1 and (r.parallel.cp == 1 or not c.ok("parallel.cp")):
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
    valid = checkpointable_names(arch)
    for name in t.checkpoint_modules:
        if name not in valid:
            hint = suggest(name, valid)
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


#: the objective each data format trains with (preference: one of several)
FORMAT_OBJECTIVES: dict[str, tuple[str, ...]] = {"text": ("lm",), "sft": ("sft",), "preference": PREFERENCE_OBJECTIVES}


def _check_fine_tuning(c: _Checker, check_paths: bool) -> None:
    """``data.format`` and ``train.objective`` go together; ``sft`` and ``preference`` rows come
    from one .jsonl file (or a prepared rows directory) rendered with the model's own tokenizer
    and chat template."""
    d, t = c.r.data, c.r.train
    if not c.ok("data.format", "train.objective"):
        return
    wanted = FORMAT_OBJECTIVES[d.format]
    if t.objective not in wanted:
        choice = wanted[0] if len(wanted) == 1 else " | ".join(wanted)
        fix = (f"set train.objective={choice}" if len(wanted) == 1
               else f"set train.objective to one of {choice}")
        owner = next(f for f, objectives in FORMAT_OBJECTIVES.items() if t.objective in objectives)
        c.add("train.objective", t.objective, f"data.format {d.format!r} trains with objective {choice}; {fix} "
                                              f"(or data.format={owner} for objective {t.objective!r})")
    if d.format == "text":
        return
    if c.ok("data.tokenizer") and d.tokenizer == "bpe" and not (check_paths and rows_directory(d.source)):
        c.add("data.tokenizer", "bpe", f"data.format {d.format!r} needs the model's tokenizer.json (its chat "
                                       f"template renders the rows), e.g. '<model.hf_path>/tokenizer.json'")
    if check_paths and c.ok("data.source") and rows_directory(d.source) is None:
        source = Path(d.source).expanduser()
        if not (source.is_file() and source.suffix.lower() == ".jsonl"):
            c.add("data.source", d.source, f"data.format {d.format!r} reads one .jsonl file of rows (or a "
                                           f"directory prepared from one); give its path")


def _check_preference(c: _Checker) -> None:
    """The ``preference`` section: set only for preference objectives, each knob meaningful for
    the chosen one, and a reference model only where the objective has one (and can build it)."""
    pr, objective = c.r.preference, c.r.train.objective
    if not c.ok("preference", "train.objective"):
        return
    if objective not in PREFERENCE_OBJECTIVES:
        defaults = type(pr)()  # a written recipe holds every field: only a changed value is a mistake
        for name in sorted(n for n in pr.model_fields_set if getattr(pr, n) != getattr(defaults, n)):
            c.add(f"preference.{name}", getattr(pr, name), f"applies to the preference objectives "
                                                           f"({', '.join(PREFERENCE_OBJECTIVES)}) only; remove it "
                                                           f"(train.objective is {objective!r})")
        return
    settings = PreferenceSettings(beta=pr.beta, label_smoothing=pr.label_smoothing, sft_weight=pr.sft_weight,
                                  gamma=pr.gamma)
    try:
        settings.check_for(objective)
    except PreferenceSettingsError as e:
        for line in str(e).splitlines()[1:]:
            name, _, rest = line.strip().partition("=")
            c.add(f"preference.{name}", getattr(pr, name), rest.split(" ", 1)[1])
    if objective not in REFERENCE_OBJECTIVES:
        if pr.reference is not None:
            c.add("preference.reference", pr.reference, f"objective {objective!r} uses no reference model; remove "
                                                        f"preference.reference (or use dpo/ipo)")
        return
    if pr.reference == "adapters_off" and c.ok("lora.rank") and c.r.lora.rank is None:
        c.add("preference.reference", pr.reference, "the policy without its adapters is the reference only with "
                                                    "LoRA; set lora.rank, or use reference frozen")


def _check_data(c: _Checker, arch: LlamaConfig | None, check_paths: bool) -> None:
    d, m = c.r.data, c.r.model
    _check_fine_tuning(c, check_paths)
    _check_preference(c)
    if d.format != "text":
        if check_paths and c.ok("data.tokenizer") and d.tokenizer != "bpe":
            tokens = _check_tokenizer_file(c)
            if tokens is not None and c.ok("model.hf_path"):
                _check_vocab_fits(c, arch, tokens)
        return
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


def _check_lora_targets(c: _Checker, arch: LlamaConfig | None) -> None:
    """Every ``lora.target_modules`` entry is a projection the model has in at least one decoder
    block (an MoE family's experts have none of the dense MLP's): read off the model built on the
    meta device, so what the rule accepts is what ``apply_lora`` adapts."""
    lo = c.r.lora
    if lo.rank is None or arch is None or not c.ok("lora.target_modules", "lora.rank"):
        return
    model = build_model(arch, single_process_mesh(), device="meta", init=False)
    present = sorted({p.target for p in projections([model])}, key=TARGETS.index)
    absent = [t for t in lo.target_modules if t not in present]
    if absent:
        c.add("lora.target_modules", list(lo.target_modules),
              f"the {type(arch).family} model has no {', '.join(absent)} projection in any decoder block, so "
              f"{'it' if len(absent) == 1 else 'they'} would adapt nothing; its projections: {present}")


def _check_lora(c: _Checker, check_paths: bool) -> None:
    """``lora.init_from`` names a PEFT adapter made with this section's settings."""
    lo = c.r.lora
    if lo.init_from is None or not c.ok("lora"):
        return
    if lo.rank is None:
        c.add("lora.init_from", lo.init_from, "starts LoRA adapters, but lora.rank is null (LoRA off); set lora.rank "
                                              "to the adapter's rank")
        return
    if not check_paths:
        return
    try:
        found = read_peft_settings(Path(lo.init_from).expanduser())
    except (PeftAdapterError, OSError) as e:
        c.add("lora.init_from", lo.init_from, f"is not a readable PEFT adapter directory ({e})")
        return
    mine = (lo.rank, float(lo.alpha), lo.rslora, sorted(lo.target_modules))
    theirs = (found.rank, float(found.alpha), found.rslora, sorted(found.target_modules))
    if mine != theirs:
        c.add("lora.init_from", lo.init_from, f"was trained with rank {found.rank}, alpha {found.alpha:g}, rslora "
                                              f"{str(found.rslora).lower()}, targets {list(found.target_modules)}; "
                                              f"set the lora section to the same")


def _check_moe(c: _Checker, arch: LlamaConfig | None, dp: int | None) -> None:
    """Mixture-of-Experts and expert-parallel rules (:mod:`plait.moe.recipe_rules`)."""
    if c.ok("moe", "parallel.tp", "parallel.ep"):
        for field, value, valid in moe_problems(c.r.moe, arch, type(arch).family if arch else c.r.model.family,
                                                tp=c.r.parallel.tp, parallel=c.r.parallel, dp=dp):
            c.add(field, value, valid)


def _check_compile(c: _Checker, arch: LlamaConfig | None) -> None:
    """``train.compile`` rules (:mod:`plait.train.compile_rules`)."""
    if c.ok("train.compile", "train.compile_mode", "parallel.schedule", "parallel.cp"):
        for problem in compile_problems(c.r, arch):
            c.add(problem.field, problem.value, problem.valid)


def _check_context_parallel(c: _Checker, arch: LlamaConfig | None) -> None:
    """Context-parallel rules (:mod:`plait.context_parallel.recipe_rules`)."""
    check_context_parallel(c, arch)


def _check_applicability(c: _Checker) -> None:
    """Keys set to something that cannot take effect for this recipe (:mod:`plait.config.applicability`)."""
    if not c.ok("data.format", "data.source"):
        return
    for problem in inapplicable_fields(c.r):
        if c.ok(problem.field):
            c.add(problem.field, problem.value, problem.valid)


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
    _check_lora(c, check_paths)
    _check_lora_targets(c, arch)
    _check_context_parallel(c, arch)
    _check_moe(c, arch, dp)
    _check_compile(c, arch)
    _check_applicability(c)
    return c.problems, c.warnings, arch
