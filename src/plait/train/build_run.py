"""A rank's run built by one function from the resolved recipe.

:func:`build_run` is the only place that turns a recipe into live training objects: the mesh, the
data, this rank's pipeline stages (one stage holding every layer when ``pp == 1``), the runtime
that drives them with a schedule (its hooks given at construction), the optimizer, the
learning-rate schedule, the objective and the feature plug-ins (:mod:`plait.train.plugins`), the
position in the data and in the RNG streams (from a checkpoint when the recipe resumes), and the
loop's tools: the batch loader, the checkpoint writer, the final export, the stall watchdog, the
metric sinks. It returns them as one :class:`~plait.train.run.Run`; the trainer only loops.

Order of construction (fixed, commented where it matters):

1. mesh, precision policy, data;
2. the global RNG seeded per (dp, pp) rank: dropout on replicated activations;
3. stages built on the meta device and materialized (only this rank's shard of its stages and,
   with ``ep > 1``, only its experts, with the token exchange set up),
   from the layout-invariant initialisation or from ``model.hf_path``; their per-TP-rank
   dropout stream reseeded from the run seed; under ZeRO-3 without LoRA the weights are only
   placeholders until step 5 (:mod:`plait.deferred`); then LoRA, and with ``lora.quantize_base``
   the base quantized projection by projection from placeholders (:mod:`plait.quantize`);
4. activation checkpointing (after the TP swap and the pipeline split, on the swapped modules), then
   ``train.compile`` (:mod:`plait.train.compile`: compiled units around the checkpointed modules);
5. the optimizer, which takes ownership of the weights (flat buffers) and gradients, and under
   ZeRO-3 computes or reads only the ranges of them this rank keeps;
6. the pipeline runtime (any ``pp``, including 1) with its hooks: the one that lets each stage's
   data-parallel reduction start during its last backward; for a preference objective, the
   loss head on the last stage and the reference model's pass (:mod:`plait.train.preference`);
   under context parallelism, the batch split;
7. the objective and the plug-ins (MoE load balancing and statistics, compile timing);
8. resume: interrupted saves removed, the checkpoint loaded, then the learning-rate schedule
   placed at the resumed step through the scheduler's public constructor;
9. the loop's tools, which depend on the start step (the loader, the metric sinks).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from plait.activation_checkpointing import apply_activation_checkpointing
from plait.checkpoint.contents import resume_target
from plait.checkpoint.store import remove_incomplete
from plait.checkpoint.writer import CheckpointWriter
from plait.config.host_memory import processes_on_this_host
from plait.config.resolve import ResolvedRecipe
from plait.config.schema import Recipe
from plait.context_parallel.apply import apply_context_parallel
from plait.context_parallel.attention import ContextParallel
from plait.context_parallel.batch import split_token_batch
from plait.data.batch import TokenBatch
from plait.data.loader import BatchLoader
from plait.data.mixture import MixtureDataset, MixtureSampler, is_mixture
from plait.data.prompt_prepare import PromptDataset
from plait.data.sampler import GlobalBatchSampler
from plait.data.sft_prepare import RowDataset
from plait.data.token_shards import TokenDataset
from plait.data_parallel.optimizer import DistributedOptimizer, OptimizerHyper
from plait.deferred import DeferredValues
from plait.devices import detect_device, peak_flops
from plait.lora import LoraSettings, apply_lora, load_peft_adapter
from plait.materialize import build_stages, build_stages_deferred, rng_tracker_of
from plait.mesh import ParallelMesh
from plait.models.decoder.config import DecoderConfig
from plait.models.family import config_of
from plait.models.flops import model_flops_per_token
from plait.moe import configure_moe, is_moe_config
from plait.moe.expert_parallel import expert_parameter_names
from plait.moe.load_map import MOE_LOAD_FILE
from plait.moe.step_load import attach_load_balancing
from plait.pipeline.hooks import LossHead, ReferencePass, RuntimeHooks
from plait.pipeline.runtime import PipelineRuntime
from plait.plan.pipeline_split import partition_for
from plait.post_training.grpo_head import GRPOHead
from plait.post_training.head import PreferenceHead
from plait.precision import PrecisionPolicy, policy_for
from plait.quantize import QuantizeSummary, quantize_base_
from plait.train.agreement import RankAgreement, StopSignals
from plait.train.checkpointing import RunCheckpoints, restore
from plait.train.compile import compile_stages, use_compile_cache
from plait.train.compile_timing import CompileTiming
from plait.train.final_export import AdapterExport, FullModelExport, run_model_use_files
from plait.train.grpo import GRPOObjective, RolloutLoader, grpo_head, grpo_objective
from plait.train.host_syncs import HostSyncDetector
from plait.train.loggers import JsonlSink, MetricsSink, MultiSink, ProgressSink, TensorBoardSink, keep_metrics_through
from plait.train.lr_schedules import build_scheduler
from plait.train.moe_statistics import MoeStatistics
from plait.train.mtp_statistics import MtpStatistics
from plait.train.objectives import NextTokenObjective, PreferenceObjective, Validation
from plait.train.plugins import FinalExport, Objective, StepPlugin
from plait.train.preference import freeze, preference_head, reference_mode_of, reference_pass_for
from plait.train.reference_precompute import attach_precomputed_reference
from plait.train.run import Run
from plait.train.run_state import Dataset, RunState
from plait.train.running_metrics import RunningMetrics
from plait.train.trackers import tracker_sinks
from plait.train.watchdog import Watchdog


def build_mesh(resolved: ResolvedRecipe, rank: int, world: int) -> ParallelMesh:
    """The rank grid; with ``parallel.shard_over: host`` also the hybrid-sharding groups, hosts being
    torchrun's ``LOCAL_WORLD_SIZE`` consecutive ranks (one host when it is not set)."""
    p = resolved.recipe.parallel
    hybrid = p.shard_over == "host" and p.zero_level() >= 1
    return ParallelMesh(world, rank, tp=p.tp, pp=p.pp, dp=resolved.dp, cp=p.cp, ep=p.ep,
                        kv_replication=resolved.kv_replication, kv_placement=p.kv_placement,
                        ranks_per_host=processes_on_this_host(world) if hybrid else None)


def stage_layers(resolved: ResolvedRecipe, config: DecoderConfig, vocab_size: int) -> list[list[int]]:
    """Decoder layers of each global stage: all of them in one stage without pipeline parallelism."""
    partition = partition_for(resolved, vocab_size)
    if partition is None:
        return [list(range(config.num_hidden_layers))]
    if resolved.recipe.parallel.pp > 1 and dist.is_initialized() and dist.get_rank() == 0:
        p = resolved.recipe.parallel
        print(f"pipeline split ({p.pp} ranks x {p.vpp} virtual stages):\n{partition.describe()}", flush=True)
    return partition.stage_layers()


def build_stages_for(resolved: ResolvedRecipe, mesh: ParallelMesh, config: DecoderConfig, vocab_size: int,
                     device: torch.device) -> list[nn.Module]:
    """This rank's stages, materialized from the initialisation or from ``model.hf_path`` (each stage
    reading only its own tensors, under every layout)."""
    r = resolved.recipe
    return build_stages(config, mesh, stage_layers(resolved, config, vocab_size), seed=r.run.seed, device=device,
                        sequence_parallel=r.parallel.sequence_parallel, hf_path=r.model.hf_path)


def build_trained_stages(resolved: ResolvedRecipe, mesh: ParallelMesh, config: DecoderConfig, vocab_size: int,
                         device: torch.device) -> tuple[list[nn.Module], DeferredValues | None]:
    """The stages the run trains. Under ZeRO-3 without LoRA (every weight trained, hence sharded)
    they hold placeholders, and the optimizer computes or reads only the ranges this rank keeps
    (see :mod:`plait.deferred`); with a quantized LoRA base they hold placeholders too, which the
    quantization fills one projection at a time (:func:`plait.quantize.quantize_base_`);
    otherwise they are built whole (:func:`build_stages_for`)."""
    r = resolved.recipe
    if not r.lora.quantized and (r.parallel.zero_level() != 3 or r.lora.rank is not None):
        return build_stages_for(resolved, mesh, config, vocab_size, device), None
    return build_placeholder_stages(resolved, mesh, config, vocab_size, device)


def build_placeholder_stages(resolved: ResolvedRecipe, mesh: ParallelMesh, config: DecoderConfig, vocab_size: int,
                             device: torch.device) -> tuple[list[nn.Module], DeferredValues]:
    """This rank's stages holding placeholders, and where their values come from (:mod:`plait.deferred`)."""
    r = resolved.recipe
    return build_stages_deferred(config, mesh, stage_layers(resolved, config, vocab_size), seed=r.run.seed,
                                 device=device, sequence_parallel=r.parallel.sequence_parallel,
                                 hf_path=r.model.hf_path)


def build_reference_stages(resolved: ResolvedRecipe, mesh: ParallelMesh, config: DecoderConfig, vocab_size: int,
                           device: torch.device, round_to: torch.dtype) -> list[nn.Module]:
    """A frozen copy of the initial model (a preference or GRPO ``frozen`` reference). With a
    quantized LoRA base it is quantized the same way, and built as the policy is (placeholders,
    one projection read and quantized at a time), so it is the policy with its adapters off."""
    lo = resolved.recipe.lora
    if not lo.quantized:
        return build_stages_for(resolved, mesh, config, vocab_size, device)
    stages, values = build_placeholder_stages(resolved, mesh, config, vocab_size, device)
    for stage in stages:
        stage.requires_grad_(False)
    quantize_base_(stages, lo.quantize_base, block_size=lo.quantize_block_size, values=values, round_to=round_to)
    return stages


def build_optimizer(resolved: ResolvedRecipe, modules: list[nn.Module], mesh: ParallelMesh,
                    policy: PrecisionPolicy, values: DeferredValues | None = None) -> DistributedOptimizer:
    """The rank's :class:`DistributedOptimizer` for the recipe (filling placeholders from ``values``)."""
    r = resolved.recipe
    o, p = r.optimizer, r.parallel
    hyper = OptimizerHyper(lr=o.lr, weight_decay=o.weight_decay, betas=(o.beta1, o.beta2), eps=o.eps, seed=r.run.seed)
    # parameter gradients are averaged over dp x cp (the dp group when cp=1): cp ranks hold the same
    # parameters and different parts of the sequences
    return DistributedOptimizer(modules, policy, hyper, dp=mesh.info("dp_cp"), tp=mesh.info("tp"),
                                pp=mesh.info("pp"), tied=mesh.info("tied") if mesh.pp > 1 else None,
                                zero=p.zero_level(), bucket_mb=p.bucket_mb, overlap=p.overlap_grad_reduce,
                                reshard_after_forward=p.reshard_after_forward, offload=p.offload_optimizer,
                                ep=mesh.info("ep"), expert_dp=mesh.info("dp_expert"),
                                expert_names=expert_parameter_names(modules), values=values,
                                hybrid=(mesh.info("dp_shard"), mesh.info("dp_replicate"))
                                if mesh.ranks_per_host is not None else None)


def build_runtime(stages: list[nn.Module], mesh: ParallelMesh, policy: PrecisionPolicy,
                  optimizer: DistributedOptimizer, *, schedule: str, microbatches: int, micro_batch_size: int,
                  seq_len: int, sequence_parallel: bool, split_batch: Callable[[TokenBatch], TokenBatch] | None = None,
                  loss_head: LossHead | None = None, reference_pass: ReferencePass | None = None) -> PipelineRuntime:
    """The runtime that drives ``stages`` (any pipeline degree, 1 included), with the hooks that let
    each stage's data-parallel reduction start just before its last backward of a step, and the
    objective's and context parallelism's hooks (see :class:`~plait.pipeline.hooks.RuntimeHooks`)."""
    device = next(stages[0].parameters()).device
    grads = optimizer.grads
    hooks = RuntimeHooks(before_last_backward=lambda chunk: grads.mark_final([stages[chunk]]),
                         mark_final_params=grads.mark_final_params,  # split backward (zb-h1): per parameter
                         loss_head=loss_head, reference_pass=reference_pass, split_batch=split_batch)
    return PipelineRuntime(stages, mesh, schedule=schedule, microbatches=microbatches,
                           micro_batch_size=micro_batch_size, seq_len=seq_len,
                           hidden_size=config_of(stages[0]).hidden_size, sequence_parallel=sequence_parallel,
                           dtype=policy.param_dtype, precision_context=lambda: policy.compute_context(device),
                           hooks=hooks)


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
    prepared fine-tuning rows (``sft``, ``preference``), or prepared prompts (``prompts``: GRPO's
    training prompts and its evaluation prompts)."""
    if recipe.data.format == "prompts":
        return PromptDataset(prepared_dir, "train"), PromptDataset(prepared_dir, "val")
    if recipe.data.format == "text" and is_mixture(prepared_dir):
        return (MixtureDataset(prepared_dir, "train", recipe.data.seq_len),
                MixtureDataset(prepared_dir, "val", recipe.data.seq_len))
    if recipe.data.format == "text":
        return (TokenDataset(prepared_dir, "train", recipe.data.seq_len),
                TokenDataset(prepared_dir, "val", recipe.data.seq_len))
    return RowDataset(prepared_dir, "train"), RowDataset(prepared_dir, "val")


def objective_for(recipe: Recipe, head: PreferenceHead | GRPOHead | None, validation: Validation,
                  prepared_dir: Path, vocab_size: int) -> Objective:
    """``train.objective``'s plug-in: the preference objectives read their head; ``lm`` on plain
    text compares with the unigram baseline of the prepared text (GRPO's, which needs the built
    run, is made by :func:`plait.train.grpo.grpo_objective`)."""
    if isinstance(head, PreferenceHead):
        return PreferenceObjective(recipe.train.objective, head, validation)
    text = recipe.data.format == "text" and not is_mixture(prepared_dir)  # a mixture: per-source val losses instead
    return NextTokenObjective(recipe.train.objective, validation, prepared_dir if text else None, vocab_size)


def plugins_for(resolved: ResolvedRecipe, stages: list[nn.Module], mesh: ParallelMesh, config: DecoderConfig,
                control: dist.ProcessGroup | None, agreement: RankAgreement, rank: int, world: int) -> list[StepPlugin]:
    """The recipe's stateful features, in the order the loop calls them."""
    r = resolved.recipe
    plugins: list[StepPlugin] = []
    if is_moe_config(config):
        # the step's expert load over the replicas (global-batch aux loss, sigmoid router bias); None if unused
        balancing = attach_load_balancing(
            stages, r.moe, mesh.info("dp_cp"), microbatches=r.parallel.microbatches,
            sequence=mesh.info("tp") if r.parallel.sequence_parallel else None)
        load_file = Path(resolved.output_dir) / MOE_LOAD_FILE if rank == 0 else None
        plugins.append(MoeStatistics(stages, balancing, control, world, load_file, plot=r.logging.plot,
                                     steps=r.train.steps))
    depths = getattr(config, "num_nextn_predict_layers", 0)
    if depths:  # multi-token prediction: its loss logged apart from the next-token loss
        plugins.append(MtpStatistics(stages, depths, control, world))
    if r.train.compile:
        plugins.append(CompileTiming(agreement))
    return plugins


def report_quantized_base(summary: QuantizeSummary, method: str, rank: int) -> None:
    """Rank 0 says what the quantization of its base weights saved (the other ranks' are alike)."""
    if rank == 0:
        mib = 1024 ** 2
        print(f"quantized base ({method}): {summary.projections} projections on rank 0, "
              f"{summary.dense_bytes / mib:.1f} MiB as read -> {summary.stored_bytes / mib:.1f} MiB, "
              f"{summary.of_bf16():.3f}x of bf16", flush=True)


def final_export_for(state: RunState, checkpoints: RunCheckpoints) -> FinalExport:
    """A LoRA run exports its adapter; every other run the whole model."""
    if state.recipe.lora.rank is not None:
        return AdapterExport(state, checkpoints)
    return FullModelExport(state, checkpoints)


def measure_peak_once(recipe: Recipe, rank: int, world: int, device: torch.device) -> float:
    """The per-device peak FLOP/s, measured (CPU) or looked up once, on rank 0, then shared.

    Measuring on one rank while the others wait keeps the matmul probe from competing with
    itself on a shared host; it also keeps the probe out of every timed interval.
    """
    dtype = "fp32" if recipe.precision.preset == "fp32" else "bf16"
    value = torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        value[0] = peak_flops(detect_device(), dtype, torch.get_num_threads())
    if world > 1:
        buf = value.to(device)  # NCCL needs a device tensor; gloo takes the CPU one
        dist.broadcast(buf, src=0)
        value = buf.cpu()
    return float(value[0])


def metric_sinks(resolved: ResolvedRecipe, out: Path, start_step: int) -> MultiSink:
    """The writing rank's sinks. A resumed run continues the run's ``metrics.jsonl`` from its start
    step (records past it, from steps trained again now, are dropped); a fresh run starts it anew.
    The trackers (W&B, MLflow) come after the local files, so those are written first."""
    recipe = resolved.recipe
    lg = recipe.logging
    out.mkdir(parents=True, exist_ok=True)
    sinks: list[MetricsSink] = []
    if lg.jsonl:
        metrics = out / "metrics.jsonl"
        resumed = start_step > 0 and metrics.is_file()
        if resumed:
            keep_metrics_through(metrics, start_step)
        sinks.append(JsonlSink(metrics, append=resumed))
    if lg.tensorboard:
        sinks.append(TensorBoardSink(out / "tensorboard"))
    sinks += tracker_sinks(resolved, start_step)
    sinks.append(ProgressSink(recipe.train.steps, enabled=lg.progress_bar, initial=start_step))
    return MultiSink(sinks)


def build_run(resolved: ResolvedRecipe, prepared_dir: str | Path, rank: int, world: int) -> Run:
    """Build this rank's :class:`~plait.train.run.Run` (see the module docstring for the order)."""
    r = resolved.recipe
    prepared_dir = Path(prepared_dir)
    out = Path(resolved.output_dir)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mesh = build_mesh(resolved, rank, world)
    policy = policy_for(r.precision.preset, r.precision.knobs())
    train_data, val_data = open_datasets(r, prepared_dir)
    seed = dropout_seed_for(r, mesh)
    torch.manual_seed(seed)
    config = r.model.to_model_config(train_data.vocab_size)  # of the recipe's family, or model.hf_path's
    stages, values = build_trained_stages(resolved, mesh, config, train_data.vocab_size, device)
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
        if lo.quantized:  # QLoRA: each rank reads and quantizes its base, a projection at a time
            summary = quantize_base_(stages, lo.quantize_base, block_size=lo.quantize_block_size, values=values,
                                     round_to=policy.param_dtype)  # the base a bf16 preset would hold
            values = None  # every placeholder is filled: the optimizer builds as for a whole model
            report_quantized_base(summary, lo.quantize_base, rank)
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
    optimizer = build_optimizer(resolved, stages, mesh, policy, values)
    p = r.parallel
    head: PreferenceHead | GRPOHead | None = preference_head(resolved, mesh, config.vocab_size, device)
    if head is None:
        head = grpo_head(resolved, mesh, config.vocab_size, device)
    reference_mode = reference_mode_of(resolved)
    reference_pass = None
    if head is not None and reference_mode is not None:
        reference_stages = None
        if reference_mode == "frozen":  # the initial model, built the same way
            reference_stages = freeze(build_reference_stages(resolved, mesh, config, train_data.vocab_size, device,
                                                             policy.param_dtype), policy.param_dtype)
        reference_pass = reference_pass_for(resolved, head, mesh, policy, config.hidden_size,
                                            lambda: policy.compute_context(device), reference_stages)
    split = None
    if p.cp > 1:  # every batch (training and evaluation) is cut to this rank's zigzag chunks
        split = partial(split_token_batch, split=context.split(r.data.seq_len), rank=context.info.rank)
    runtime = build_runtime(stages, mesh, policy, optimizer, schedule=p.schedule, microbatches=p.microbatches,
                            micro_batch_size=r.data.micro_batch_size, seq_len=r.data.seq_len // p.cp,
                            sequence_parallel=p.sequence_parallel, split_batch=split, loss_head=head,
                            reference_pass=reference_pass)
    control = _control_group(world)
    watchdog = Watchdog(t.stall_timeout_s, rank, dump_dir=out)  # hang/rank-N.txt on a stall
    agreement = RankAgreement(control, watchdog)
    validation = Validation(runtime, val_data, global_batch=resolved.global_batch_size, batches=t.eval_batches,
                            microbatches=p.microbatches, micro_batch_size=r.data.micro_batch_size,
                            dp=mesh.info("dp"), pp=mesh.info("pp"))
    state = RunState(resolved=resolved, rank=rank, world=world, device=device, mesh=mesh, policy=policy,
                     config=config, stages=stages, runtime=runtime, optimizer=optimizer,
                     scheduler=scheduler_at(optimizer.inner, r, 0), train_data=train_data, val_data=val_data,
                     dropout_seed=seed, control=control,
                     objective=objective_for(r, head, validation, prepared_dir, train_data.vocab_size),
                     plugins=plugins_for(resolved, stages, mesh, config, control, agreement, rank, world))
    if isinstance(head, GRPOHead):  # its loader samples each step's batch from the policy
        assert isinstance(train_data, PromptDataset) and isinstance(val_data, PromptDataset), "format prompts"
        state.objective = grpo_objective(resolved, state, head, train_data, val_data)
    if isinstance(head, PreferenceHead) and reference_mode == "precompute":
        attach_precomputed_reference(state, head, prepared_dir)  # scored by the initial model
    state.start_step = _resume(state)  # the checkpoint is restored into this state
    state.scheduler = scheduler_at(optimizer.inner, r, state.start_step)
    c = r.checkpoint
    checkpoints = RunCheckpoints(state, CheckpointWriter(resolved.save_dir, rank=rank, world=world, keep=c.keep,
                                                         keep_every=c.keep_every),
                                 run_model_use_files(state), asynchronous=c.async_save)
    loader: BatchLoader | RolloutLoader
    if isinstance(state.objective, GRPOObjective):
        loader = state.objective.loader
        loader.step = state.start_step
    else:
        sampler = (MixtureSampler(train_data.sizes, train_data.weights, resolved.global_batch_size, r.run.seed)
                   if isinstance(train_data, MixtureDataset)
                   else GlobalBatchSampler(len(train_data), resolved.global_batch_size, r.run.seed))
        loader = BatchLoader(train_data, sampler, dp_rank=state.dp.rank, dp=state.dp.size,
                             microbatches=p.microbatches, prefetch=r.data.prefetch, start_step=state.start_step)
    fpt = model_flops_per_token(config, r.data.seq_len, weight_gradients=lo.rank is None)  # a frozen base: 4N
    peak = measure_peak_once(r, rank, world, device)  # before the sinks start their threads
    return Run(state=state, loader=loader, checkpoints=checkpoints, export=final_export_for(state, checkpoints),
               watchdog=watchdog, signals=StopSignals(agreement), metrics=RunningMetrics(device),
               sinks=metric_sinks(resolved, out, state.start_step) if rank == 0 else None,
               host_syncs=HostSyncDetector(device, steps=3 if t.detect_host_syncs else 0),
               peak_flops=peak, flops_per_token=fpt, out=out)
