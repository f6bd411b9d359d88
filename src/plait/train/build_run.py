"""A rank's run built by one function from the resolved recipe.

:func:`build_run` is the only place that turns a recipe into live training objects: the mesh, the
data, this rank's pipeline stages (one stage holding every layer when ``pp == 1``), the runtime
that drives them with a schedule, the optimizer, the learning-rate schedule, and the position in
the data and in the RNG streams (from a checkpoint when the recipe resumes). The training loop,
the checkpoint writer and reader, evaluation and the end-of-run outputs all take the
:class:`RunState` it returns; nothing receives "the whole trainer".

Order of construction (fixed, commented where it matters):

1. mesh, precision policy, data;
2. the global RNG seeded per (dp, pp) rank: dropout on replicated activations;
3. stages built on the meta device and materialized (only this rank's shard of its stages and,
   with ``ep > 1``, only its experts, with the token exchange set up),
   from the layout-invariant initialisation or from ``model.hf_path``; their per-TP-rank
   dropout stream reseeded from the run seed;
4. activation checkpointing (after the TP swap and the pipeline split, on the swapped modules), then
   ``train.compile`` (:mod:`plait.train.compile`: compiled units around the checkpointed modules);
5. the optimizer, which takes ownership of the weights (flat buffers) and gradients;
6. the pipeline runtime (any ``pp``, including 1) and its hook that lets each stage's
   data-parallel reduction start during its last backward; for a preference objective, the
   loss head on the last stage and the reference model's pass (:mod:`plait.train.preference`);
7. resume: interrupted saves removed, the checkpoint loaded, then the learning-rate schedule
   placed at the resumed step through the scheduler's public constructor.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from plait.activation_checkpointing import apply_activation_checkpointing
from plait.checkpoint.contents import resume_target
from plait.checkpoint.store import remove_incomplete
from plait.checkpoint.training import restore
from plait.config.resolve import ResolvedRecipe
from plait.config.schema import Recipe
from plait.context_parallel.apply import apply_context_parallel
from plait.context_parallel.attention import ContextParallel
from plait.context_parallel.batch import split_token_batch
from plait.data.sft_prepare import RowDataset
from plait.data.token_shards import TokenDataset
from plait.data_parallel.optimizer import DistributedOptimizer, OptimizerHyper
from plait.lora import LoraSettings, apply_lora, load_peft_adapter
from plait.materialize import build_stages, rng_tracker_of
from plait.mesh import ParallelMesh
from plait.models.family import config_of
from plait.models.llama.config import LlamaConfig
from plait.moe import configure_moe
from plait.moe.expert_parallel import expert_parameter_names
from plait.pipeline.layout import partition_for
from plait.pipeline.runtime import PipelineRuntime
from plait.precision import PrecisionPolicy, policy_for
from plait.train.compile import compile_stages, use_compile_cache
from plait.train.preference import attach_preference, freeze
from plait.train.reference_precompute import attach_precomputed_reference
from plait.train.run_state import Dataset, RunState
from plait.train.schedules import build_scheduler


def build_mesh(resolved: ResolvedRecipe, rank: int, world: int) -> ParallelMesh:
    p = resolved.recipe.parallel
    return ParallelMesh(world, rank, tp=p.tp, pp=p.pp, dp=resolved.dp, cp=p.cp, ep=p.ep,
                        kv_replication=resolved.kv_replication, kv_placement=p.kv_placement)


def stage_layers(resolved: ResolvedRecipe, config: LlamaConfig, vocab_size: int) -> list[list[int]]:
    """Decoder layers of each global stage: all of them in one stage without pipeline parallelism."""
    partition = partition_for(resolved, vocab_size)
    if partition is None:
        return [list(range(config.num_hidden_layers))]
    if resolved.recipe.parallel.pp > 1 and dist.is_initialized() and dist.get_rank() == 0:
        p = resolved.recipe.parallel
        print(f"pipeline split ({p.pp} ranks x {p.vpp} virtual stages):\n{partition.describe()}", flush=True)
    return partition.stage_layers()


def build_stages_for(resolved: ResolvedRecipe, mesh: ParallelMesh, config: LlamaConfig, vocab_size: int,
                     device: torch.device) -> list[nn.Module]:
    """This rank's stages, materialized from the initialisation or from ``model.hf_path`` (each stage
    reading only its own tensors, under every layout)."""
    r = resolved.recipe
    return build_stages(config, mesh, stage_layers(resolved, config, vocab_size), seed=r.run.seed, device=device,
                        sequence_parallel=r.parallel.sequence_parallel, hf_path=r.model.hf_path)


def build_optimizer(resolved: ResolvedRecipe, modules: list[nn.Module], mesh: ParallelMesh,
                    policy: PrecisionPolicy) -> DistributedOptimizer:
    """The rank's :class:`DistributedOptimizer` for the recipe."""
    r = resolved.recipe
    o, p = r.optimizer, r.parallel
    hyper = OptimizerHyper(lr=o.lr, weight_decay=o.weight_decay, betas=(o.beta1, o.beta2), eps=o.eps, seed=r.run.seed)
    # parameter gradients are averaged over dp x cp (the dp group when cp=1): cp ranks hold the same
    # parameters and different parts of the sequences
    return DistributedOptimizer(modules, policy, hyper, dp=mesh.info("dp_cp"), tp=mesh.info("tp"),
                                pp=mesh.info("pp"), tied=mesh.info("tied") if mesh.pp > 1 else None,
                                zero=p.zero1, bucket_mb=p.bucket_mb, overlap=p.overlap_grad_reduce,
                                ep=mesh.info("ep"), expert_dp=mesh.info("dp_expert"),
                                expert_names=expert_parameter_names(modules))


def build_runtime(stages: list[nn.Module], mesh: ParallelMesh, policy: PrecisionPolicy,
                  optimizer: DistributedOptimizer, *, schedule: str, microbatches: int, micro_batch_size: int,
                  seq_len: int, sequence_parallel: bool) -> PipelineRuntime:
    """The runtime that drives ``stages`` (any pipeline degree, 1 included), with the hook that lets
    each stage's data-parallel reduction start just before its last backward of a step."""
    device = next(stages[0].parameters()).device
    runtime = PipelineRuntime(stages, mesh, schedule=schedule, microbatches=microbatches,
                              micro_batch_size=micro_batch_size, seq_len=seq_len,
                              hidden_size=config_of(stages[0]).hidden_size, sequence_parallel=sequence_parallel,
                              dtype=policy.param_dtype, precision_context=(lambda: policy.compute_context(device)))
    grads = optimizer.grads
    runtime.before_last_backward = lambda chunk: grads.mark_final([stages[chunk]])
    runtime.mark_final_params = grads.mark_final_params  # split backward (zb-h1): per parameter, after its last W
    return runtime


def context_parallel_for(recipe: Recipe, mesh: ParallelMesh) -> ContextParallel:
    """This rank's cp group and the recipe's ``parallel.cp_mode``."""
    return ContextParallel(mesh.info("cp"), tuple(mesh.my_group_ranks("cp")), mode=recipe.parallel.cp_mode)


def dropout_seed_for(recipe: Recipe, mesh: ParallelMesh) -> int:
    """The global generator's seed: equal within a TP group (same replicated activations), different
    across data-parallel replicas and pipeline stages."""
    return recipe.run.seed * 1_000_003 + 7919 * (mesh.info("dp").rank * mesh.pp + mesh.info("pp").rank)


def _control_group(world: int) -> dist.ProcessGroup | None:
    if world == 1:
        return None
    return dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def _resume(state: RunState) -> int:
    """Remove interrupted saves and load the checkpoint ``checkpoint.resume`` names; the start step."""
    c, root = state.recipe.checkpoint, Path(state.resolved.save_dir)
    if state.rank == 0:
        for d in remove_incomplete(root):
            print(f"removed the interrupted checkpoint {d}", flush=True)
    if state.world > 1:
        dist.barrier(group=state.control)
    if c.resume == "none":
        return 0
    directory = resume_target(state.recipe, root)
    if directory is None:
        if state.rank == 0:
            print(f"checkpoint.resume=auto: no complete checkpoint in {root}; starting from step 0", flush=True)
        return 0
    step = restore(state, directory)
    if state.rank == 0:
        print(f"resumed from {directory} at step {step}", flush=True)
    return step


def scheduler_at(optimizer: torch.optim.Optimizer, recipe: Recipe, step: int) -> LambdaLR:
    """The learning-rate schedule positioned after ``step`` optimizer steps (the constructor's own
    resume path: ``initial_lr`` in the parameter groups and ``last_epoch``)."""
    s = recipe.scheduler
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    return build_scheduler(optimizer, name=s.name, warmup_steps=s.warmup_steps, total_steps=recipe.train.steps,
                           min_ratio=s.min_lr_ratio, last_epoch=step - 1)


def open_datasets(recipe: Recipe, prepared_dir: str | Path) -> tuple[Dataset, Dataset]:
    """The train and validation splits: token streams cut into ``seq_len`` sequences (``text``), or
    prepared fine-tuning rows (``sft``, ``preference``)."""
    if recipe.data.format == "text":
        return (TokenDataset(prepared_dir, "train", recipe.data.seq_len),
                TokenDataset(prepared_dir, "val", recipe.data.seq_len))
    return RowDataset(prepared_dir, "train"), RowDataset(prepared_dir, "val")


def build_run(resolved: ResolvedRecipe, prepared_dir: str | Path, rank: int, world: int) -> RunState:
    """Build this rank's :class:`RunState` (see the module docstring for the order)."""
    r = resolved.recipe
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mesh = build_mesh(resolved, rank, world)
    policy = policy_for(r.precision.preset, r.precision.knobs())
    train_data, val_data = open_datasets(r, prepared_dir)
    seed = dropout_seed_for(r, mesh)
    torch.manual_seed(seed)
    config = r.model.to_model_config(train_data.vocab_size)  # of the recipe's family, or model.hf_path's
    stages = build_stages_for(resolved, mesh, config, train_data.vocab_size, device)
    context = context_parallel_for(r, mesh)
    apply_context_parallel(stages, context, r.data.seq_len)  # attention and loss over cp (no-op at cp=1)
    for stage in stages:  # the per-TP-rank dropout stream follows the same run seed
        rng_tracker_of(stage).reseed(seed)
    lo = r.lora
    if lo.rank is not None:  # after the weights are read: the base is frozen, only adapters train
        apply_lora(stages, LoraSettings(rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout,
                                        target_modules=tuple(lo.target_modules), rslora=lo.rslora), seed=r.run.seed)
        if lo.init_from is not None:  # continue from an adapter: each rank reads only its slices
            load_peft_adapter(stages, Path(lo.init_from).expanduser())
    # MoE layers (the builder already kept this rank's experts and set up the token exchange when
    # ep > 1): the aux/z-loss weights, which carry the step's normalisation (no-op for dense models)
    configure_moe(stages, r.moe, config, microbatches=r.parallel.microbatches,
                  sequence_shards=mesh.tp if r.parallel.sequence_parallel else 1)
    t = r.train
    if t.activation_checkpointing != "off":
        apply_activation_checkpointing(stages, t.activation_checkpointing, t.checkpoint_modules or None)
    if t.compile:  # last: compiles the parallel, adapted, split and checkpointed modules (docs/compile.md)
        use_compile_cache(r.data.cache_dir)
        compile_stages(stages, t.compile_mode)
    optimizer = build_optimizer(resolved, stages, mesh, policy)
    p = r.parallel
    runtime = build_runtime(stages, mesh, policy, optimizer, schedule=p.schedule, microbatches=p.microbatches,
                            micro_batch_size=r.data.micro_batch_size, seq_len=r.data.seq_len // p.cp,
                            sequence_parallel=p.sequence_parallel)
    if p.cp > 1:  # every batch (training and evaluation) is cut to this rank's zigzag chunks
        runtime.split_batch = partial(split_token_batch, split=context.split(r.data.seq_len), rank=context.info.rank)
    reference_stages = None
    if r.preference.reference_mode(t.objective, lo.rank) == "frozen":  # the initial model, built the same way
        reference_stages = freeze(build_stages_for(resolved, mesh, config, train_data.vocab_size, device),
                                  policy.param_dtype)
    head = attach_preference(resolved, runtime, mesh, policy, config.vocab_size, reference_stages)
    state = RunState(resolved=resolved, rank=rank, world=world, device=device, mesh=mesh, policy=policy,
                     config=config, stages=stages, runtime=runtime, optimizer=optimizer,
                     scheduler=scheduler_at(optimizer.inner, r, 0), train_data=train_data, val_data=val_data,
                     dropout_seed=seed, control=_control_group(world), preference=head,
                     reference_stages=reference_stages)
    if r.preference.reference_mode(t.objective, lo.rank) == "precompute":  # scored by the initial model
        attach_precomputed_reference(state, prepared_dir)
    state.start_step = _resume(state)  # the checkpoint is restored into this state
    state.scheduler = scheduler_at(optimizer.inner, r, state.start_step)
    return state
