"""Values derived from a valid recipe: world size, dp, KV replication, batch sizes, directories,
and, once the vocabulary is known, the parameter count and model FLOPs per token."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any

from plait.config.schema import ARCH_FIELDS, Recipe
from plait.models.decoder.config import DecoderConfig
from plait.models.flops import model_flops_per_token
from plait.tensor_parallel.heads import HeadLayout


@dataclass(frozen=True)
class ModelNumbers:
    """Model-dependent numbers for one vocabulary size."""

    vocab_size: int
    num_parameters: int
    non_embedding_parameters: int
    flops_per_token: int
    flops_per_step: int


@dataclass(frozen=True)
class ResolvedRecipe:
    """A validated recipe and the values derived from it for one world size."""

    recipe: Recipe
    world_size: int
    dp: int
    kv_replication: int
    global_batch_size: int
    tokens_per_step: int
    output_dir: str
    checkpoint_dir: str
    save_dir: str = ""
    #: the architecture read from ``model.hf_path`` (``None`` without one)
    hf_config: DecoderConfig | None = None
    warnings: tuple[str, ...] = field(default=())

    # ------------------------------------------------------------------ shortcuts
    @property
    def tp(self) -> int:
        return self.recipe.parallel.tp

    @property
    def pp(self) -> int:
        return self.recipe.parallel.pp

    @property
    def microbatches(self) -> int:
        return self.recipe.parallel.microbatches

    def head_layout(self) -> HeadLayout:
        """The :class:`~plait.tensor_parallel.heads.HeadLayout` of the attention heads over TP."""
        c = self.model_config(self.vocab_size_hint()[0])
        return HeadLayout.plan(c.num_attention_heads, c.num_key_value_heads, c.head_dim, self.tp,
                               self.kv_replication, self.recipe.parallel.kv_placement)

    # ------------------------------------------------------------------ model-dependent numbers
    def vocab_size_hint(self) -> tuple[int, str]:
        """``(vocab size, where it comes from)`` before the tokenizer exists: ``model.vocab_size``,
        else the checkpoint's ``config.json``, else ``data.vocab_size`` (exact for ``tokenizer: bpe``)."""
        if self.hf_config is not None:
            return self.hf_config.vocab_size, "model.hf_path config.json"
        if self.recipe.model.vocab_size is not None:
            return self.recipe.model.vocab_size, "model.vocab_size"
        return self.recipe.data.vocab_size, "data.vocab_size"

    def model_config(self, vocab_size: int | None = None, **extra: Any) -> DecoderConfig:
        """The model's config, of its family (``model.family``, or ``model.hf_path``'s model_type),
        for a tokenizer of ``vocab_size`` tokens (``None``: :meth:`vocab_size_hint`)."""
        if self.hf_config is not None:
            config = copy.deepcopy(self.hf_config)
            for key, value in extra.items():
                setattr(config, key, value)
            return config
        return self.recipe.model.to_model_config(vocab_size or self.vocab_size_hint()[0], **extra)

    @property
    def family(self) -> str:
        """The model family's name."""
        return type(self.hf_config).family if self.hf_config is not None else self.recipe.model.family

    def num_parameters(self, vocab_size: int | None = None) -> int:
        return self.model_config(vocab_size).num_parameters()

    def flops_per_token(self, vocab_size: int | None = None) -> int:
        return model_flops_per_token(self.model_config(vocab_size), self.recipe.data.seq_len)

    def model_numbers(self, vocab_size: int | None = None) -> ModelNumbers:
        c = self.model_config(vocab_size)
        n = c.num_parameters()
        embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
        fpt = model_flops_per_token(c, self.recipe.data.seq_len)
        return ModelNumbers(c.vocab_size, n, n - embed, fpt, fpt * self.tokens_per_step)

    # ------------------------------------------------------------------ presentation
    def derived(self, vocab_size: int | None = None) -> dict[str, Any]:
        """The derived values as a flat mapping (what ``plait config show`` prints)."""
        vocab, source = (vocab_size, "given") if vocab_size is not None else self.vocab_size_hint()
        numbers = self.model_numbers(vocab)
        return {
            "world_size": self.world_size, "tp": self.tp, "pp": self.pp, "dp": self.dp,
            "kv_replication": self.kv_replication, "microbatches": self.microbatches,
            "global_batch_size": self.global_batch_size, "tokens_per_step": self.tokens_per_step,
            "output_dir": self.output_dir, "checkpoint_dir": self.checkpoint_dir, "save_dir": self.save_dir,
            "vocab_size": f"{numbers.vocab_size} (from {source})",
            "parameters": numbers.num_parameters, "non_embedding_parameters": numbers.non_embedding_parameters,
            "flops_per_token": numbers.flops_per_token, "flops_per_step": numbers.flops_per_step,
        }

    def summary_line(self) -> str:
        p = self.recipe.parallel
        cp = f" cp={p.cp}" if p.cp > 1 else ""
        ep = f" ep={p.ep}" if p.ep > 1 else ""
        return (f"tp={p.tp} pp={p.pp} dp={self.dp}{cp}{ep} (world {self.world_size}), "
                f"kv_replication={self.kv_replication}, "
                f"{self.global_batch_size} x {self.recipe.data.seq_len} = {self.tokens_per_step} tokens/step, "
                f"{self.recipe.train.steps} steps -> {self.output_dir}")

    def as_recipe(self) -> Recipe:
        """The recipe with the derived values written in (dp, kv_replication, global batch size,
        directories, and the architecture of ``model.hf_path``), for saving next to a run."""
        data = self.recipe.model_dump()
        data["parallel"].update(dp=self.dp, kv_replication=self.kv_replication)
        data["data"]["global_batch_size"] = self.global_batch_size
        data["run"]["output_dir"] = self.output_dir.replace("{", "{{").replace("}", "}}")
        data["checkpoint"]["dir"] = self.checkpoint_dir.replace("{", "{{").replace("}", "}}")
        data["checkpoint"]["save_dir"] = self.save_dir.replace("{", "{{").replace("}", "}}")
        if self.hf_config is not None:
            data["model"].update({name: getattr(self.hf_config, name, None) for name in ARCH_FIELDS})
            data["model"]["family"] = type(self.hf_config).family
        return Recipe.model_validate(data)


def derive_world_and_dp(tp: int, pp: int, dp: int | None, world_size: int | None, cp: int = 1) -> tuple[int, int]:
    """``(world_size, dp)``: without a world size, ``tp * pp * cp * (dp or 1)`` processes are assumed."""
    if world_size is None:
        return tp * pp * cp * (dp or 1), dp or 1
    return world_size, dp if dp is not None else world_size // (tp * pp * cp)


def resolve(recipe: Recipe, world_size: int | None, *, hf_config: DecoderConfig | None = None,
            warnings: list[str] | tuple[str, ...] = ()) -> ResolvedRecipe:
    """Derive the values of a recipe that :func:`~plait.config.rules.collect_problems` accepted."""
    r, p = recipe, recipe.parallel
    world, dp = derive_world_and_dp(p.tp, p.pp, p.dp, world_size, p.cp)
    arch = hf_config or r.model.to_model_config(r.model.vocab_size or r.data.vocab_size)
    kv = HeadLayout.plan(arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, p.tp,
                         p.kv_replication, p.kv_placement).kv_replication
    gbs = r.data.global_batch_size or r.data.micro_batch_size * p.microbatches * dp
    # ~ means the home directory, as in a shell (the recipe's text is never passed through one)
    out = os.path.expanduser(r.run.output_dir.format(name=r.run.name))
    ckpt = os.path.expanduser(r.checkpoint.dir.format(output_dir=out, name=r.run.name))
    save_dir = os.path.expanduser(r.checkpoint.save_dir.format(output_dir=out, name=r.run.name))
    return ResolvedRecipe(recipe=r, world_size=world, dp=dp, kv_replication=kv, global_batch_size=gbs,
                          tokens_per_step=gbs * r.data.seq_len, output_dir=out, checkpoint_dir=ckpt, save_dir=save_dir,
                          hf_config=hf_config, warnings=tuple(warnings))


# ---------------------------------------------------------------------- the default recipe's layout
@dataclass(frozen=True)
class DefaultDegrees:
    """The parallel layout given to the built-in default recipe for an explicit process count."""

    nproc: int
    tp: int
    dp: int
    sequence_parallel: bool

    def overrides(self) -> list[str]:
        """The ``parallel.*`` overrides that give the default recipe this layout."""
        return [f"parallel.tp={self.tp}", f"parallel.sequence_parallel={'true' if self.sequence_parallel else 'false'}"]

    def describe(self) -> str:
        sp = ", sequence parallelism" if self.sequence_parallel else ""
        return (f"the built-in default recipe on {self.nproc} process(es): tp={self.tp} dp={self.dp}{sp} "
                f"(set parallel.* to choose another layout)")


#: tensor-parallel degrees the default recipe's model takes, best first (8 query heads, 4 KV heads,
#: intermediate size 768 and 128-token sequences divide by each)
DEFAULT_TP_CHOICES = (2, 1)


def choose_default_layout(nproc: int, tp_choices: tuple[int, ...] = DEFAULT_TP_CHOICES) -> DefaultDegrees:
    """The layout of the built-in default recipe on ``nproc`` processes: the largest tensor-parallel
    degree of ``tp_choices`` that divides ``nproc``, data parallelism over the rest, and sequence
    parallelism only where there is a TP group to split over.

    The default recipe is written for two processes (tp=2 with sequence parallelism); carried over
    unchanged it fails for any odd ``nproc``. A user's own recipe keeps its layout (and its error).
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc={nproc!r} must be a positive integer")
    tp = next(t for t in (*sorted(tp_choices, reverse=True), 1) if nproc % t == 0)
    return DefaultDegrees(nproc=nproc, tp=tp, dp=nproc // tp, sequence_parallel=tp > 1)


def sets_parallel(overrides: list[str]) -> bool:
    """True when an override sets the ``parallel`` section or one of its fields."""
    return any(item.split("=", 1)[0].split(".", 1)[0].strip() == "parallel" for item in overrides)


def default_layout_for(recipe_path: str | None, overrides: list[str], nproc: int | None) -> DefaultDegrees | None:
    """The layout to give the built-in default recipe (no recipe file, an explicit ``nproc`` and no
    ``parallel.*`` override); ``None`` when the recipe's own layout stands."""
    if recipe_path is not None or nproc is None or sets_parallel(overrides):
        return None
    return choose_default_layout(nproc)
