"""How each section of an NxDT config becomes plait recipe fields (the mapping, key by key).

The handlers record every key they look at in a :class:`~plait.interop.nxdt_collect.Collector`:
mapped (to which plait fields), ignored (why it does not matter to plait) or not mapped (why
plait cannot express it). Values are taken as NxDT gives them; whether plait accepts them is
decided afterwards by plait's own validation (:mod:`plait.interop.nxdt`), not re-implemented here.
The ``model`` section is :mod:`plait.interop.nxdt_model`, ``optim`` and ``precision`` are
:mod:`plait.interop.nxdt_numerics`. See docs/nxdt.md for the table.
"""

from __future__ import annotations

from typing import Any

from plait.interop.nxdt_collect import Collector

NEURON_ONLY = "a Neuron compiler/runtime setting; plait does not run on the Neuron stack"
NOT_NUMERIC = "an implementation choice of NxD that does not change the model's numerics"

#: top-level keys that only configure the Neuron toolchain
_TOP_IGNORED = {
    "compiler_flags": NEURON_ONLY, "compiler_cache_url": NEURON_ONLY, "aync_exec_max_inflight_requests": NEURON_ONLY,
    "async_exec_max_inflight_requests": NEURON_ONLY, "bucket_size_collectives": NEURON_ONLY,
    "neuron_rt_exec_timeout": NEURON_ONLY, "neuron_experimental_compress_rg": NEURON_ONLY,
    "model_source": "plait has one implementation of each model family (NxDT's hf/megatron choice)",
}
_TRAINER_IGNORED = {
    "max_epochs": "plait trains for train.steps optimizer steps",
    "check_val_every_n_epoch": "plait evaluates by step (train.eval_every)",
    "num_sanity_val_steps": "plait runs no sanity validation before training",
    "limit_test_batches": "plait has no test split",
    "enable_progress_bar": "see logging.progress_bar", "logger": "plait's metric sinks are logging.*",
    "enable_checkpointing": "checkpointing is exp_manager's (see checkpoint.save_every)",
    "precision": "NxDT's precision section decides the precision",
    "accelerator": "plait picks the device from the backend",
}
_EXP_IGNORED = {
    "log_local_rank_0_only": "plait logs from rank 0 only",
    "resume_ignore_no_checkpoint": "checkpoint.resume 'auto' starts fresh when there is no checkpoint",
    "checkpoint_callback_params.monitor": "plait keeps the newest checkpoints (NxDT's monitor: step)",
    "checkpoint_callback_params.mode": "plait keeps the newest checkpoints (NxDT's mode: max on step)",
    "checkpoint_callback_params.save_last": "plait's newest checkpoint is always kept",
    "checkpoint_callback_params.filename": "plait names checkpoints step-N",
    "checkpoint_callback_params.use_master_weights_in_ckpt": "plait's checkpoints always hold the master "
                                                             "weights when there are any",
    "save_xser": "Neuron's xser tensor serialization; plait writes its own sharded format",
    "load_xser": "Neuron's xser tensor serialization; plait writes its own sharded format",
    "save_bf16": "plait saves the weights in their training dtype",
    "log_parameter_norm": "plait's metrics are fixed (loss, gradient norm, throughput)",
    "log_gradient_norm": "plait always logs the gradient norm",
    "enable_recovery_time_instrumentation": NEURON_ONLY,
}
#: NxDT precision.type -> plait precision.preset
PRECISION_TYPES = {"fp32": "fp32", "autocast": "autocast", "mixed_precision": "bf16-mixed",
                   "mixed_precisionSR": "bf16-mixed", "bf16SR": "bf16-pure", "manual": "manual"}
#: NxDT optim.sched.name -> plait scheduler.name
SCHEDULES = {"CosineAnnealing": "cosine", "LinearAnnealingWithWarmUp": "linear", "LinearAnnealing": "linear",
             "WarmupPolicy": "constant", "WarmupHoldPolicy": "constant", "ConstantLR": "constant",
             "constant": "constant", "cosine": "cosine", "linear": "linear"}


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def one_of(value: Any, choices: Any) -> bool:
    """``value in choices`` for plain values; a list or mapping (unhashable) is in none of them."""
    return isinstance(value, (str, int, float, type(None))) and value in choices


def flag(value: Any) -> bool | None:
    """An NxDT on/off value (``True``, ``1``, ``'1'``, ``'true'``) as a bool; ``None`` if it is none of them."""
    if isinstance(value, bool):
        return value
    if is_int(value) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("0", "1", "true", "false"):
        return value.strip().lower() in ("1", "true")
    return None


def ignore_listed(c: Collector, prefix: str, table: dict[str, str]) -> None:
    for key, reason in table.items():
        if c.has(prefix + key) and not c.done(prefix + key):
            c.ignore(prefix + key, reason)


# ---------------------------------------------------------------------- top level and trainer
def import_top(c: Collector) -> None:
    ignore_listed(c, "", _TOP_IGNORED)
    if c.has("seed"):
        c.map("seed", {"run.seed": c.get("seed")})
    for key in ("model_alignment_strategy", "data.alignment_strategy"):
        if c.has(key):
            c.unmap(key, "not imported: plait's fine-tuning is data.format sft|preference with train.objective "
                         "(docs/post_training.md maps the keys); the recipe trains next-token loss on whole "
                         "documents")


def import_trainer(c: Collector) -> int | None:
    """Maps ``trainer``; returns the world size (devices * num_nodes) when the config gives it."""
    t = "trainer."
    ignore_listed(c, t, _TRAINER_IGNORED)
    steps = c.get(t + "max_steps")
    if c.has(t + "max_steps"):
        if is_int(steps) and steps > 0:
            c.map(t + "max_steps", {"train.steps": steps})
        else:
            c.unmap(t + "max_steps", "plait trains for a number of steps; set train.steps")
    for key, name in (("log_every_n_steps", "train.log_every"), ("val_check_interval", "train.eval_every")):
        if c.has(t + key):
            value = c.get(t + key)
            if is_int(value):
                c.map(t + key, {name: value})
            else:
                c.unmap(t + key, f"a fraction of an epoch; plait counts {name} in steps")
    if c.has(t + "limit_val_batches"):
        value = c.get(t + "limit_val_batches")
        if is_int(value) and value >= 1:
            c.map(t + "limit_val_batches", {"train.eval_batches": value})
        elif value in (0, 0.0):
            c.unmap(t + "limit_val_batches", "plait cannot turn validation off; it evaluates "
                                             "train.eval_batches global batches every train.eval_every steps")
        else:
            c.unmap(t + "limit_val_batches", "a fraction of the validation set; plait counts train.eval_batches "
                                             "in global batches")
    if c.has(t + "gradient_clip_val"):
        clip = c.get(t + "gradient_clip_val")
        c.map(t + "gradient_clip_val", {"optimizer.grad_clip": 0.0 if clip is None else clip})
    return _world_size(c)


def _world_size(c: Collector) -> int | None:
    devices, nodes = c.get("trainer.devices"), c.get("trainer.num_nodes", 1)
    if not c.has("trainer.devices"):
        return None
    if not (is_int(devices) and devices >= 1 and is_int(nodes) and nodes >= 1):
        c.unmap("trainer.devices", "not a device count; the world size (and so dp) stays open")
        return None
    c.ignore("trainer.devices", f"with trainer.num_nodes gives the world size {devices * nodes} (dp is derived "
                                "from it); plait's world size is --nproc or torchrun's")
    if c.has("trainer.num_nodes"):
        c.ignore("trainer.num_nodes", "see trainer.devices")
    return devices * nodes


# ---------------------------------------------------------------------- exp_manager
def import_exp_manager(c: Collector) -> None:
    e = "exp_manager."
    ignore_listed(c, e, _EXP_IGNORED)
    if c.get(e + "name") is not None:
        c.map(e + "name", {"run.name": c.get(e + "name")})
        if c.has("name"):
            c.ignore("name", "exp_manager.name names the run")
    elif c.has("name"):
        c.map("name", {"run.name": c.get("name")})
    if c.get(e + "explicit_log_dir") is not None:
        c.map(e + "explicit_log_dir", {"run.output_dir": c.get(e + "explicit_log_dir")})
        if c.has(e + "exp_dir"):
            c.ignore(e + "exp_dir", "exp_manager.explicit_log_dir decides the output directory")
    elif c.get(e + "exp_dir") is not None:
        c.map(e + "exp_dir", {"run.output_dir": f"{c.get(e + 'exp_dir')}/{{name}}"}, "outputs in EXP_DIR/<run name>")
    for key in ("explicit_log_dir", "exp_dir"):
        if c.has(e + key) and c.get(e + key) is None and not c.done(e + key):
            c.ignore(e + key, "not set: plait's default run.output_dir (runs/{name})")
    for key, name in (("create_tensorboard_logger", "logging.tensorboard"), ("async_checkpointing",
                                                                             "checkpoint.async_save")):
        if c.has(e + key):
            c.map(e + key, {name: c.get(e + key)})
    _checkpoints(c)


def _checkpoints(c: Collector) -> None:
    e, p = "exp_manager.", "exp_manager.checkpoint_callback_params."
    if c.get(e + "create_checkpoint_callback") is False:
        c.map(e + "create_checkpoint_callback", {"checkpoint.save_every": 0}, "no periodic checkpoints")
    elif c.has(e + "create_checkpoint_callback"):
        c.ignore(e + "create_checkpoint_callback", "checkpoints are on; see every_n_train_steps")
    every = c.get(p + "every_n_train_steps")
    if c.has(p + "every_n_train_steps"):
        if c.value("checkpoint.save_every") == 0:
            c.ignore(p + "every_n_train_steps", "create_checkpoint_callback is false")
        else:
            c.map(p + "every_n_train_steps", {"checkpoint.save_every": every})
    if c.has(p + "save_top_k"):
        top = c.get(p + "save_top_k")
        if is_int(top) and top >= 1:
            c.map(p + "save_top_k", {"checkpoint.keep": top})
        elif top == -1 and is_int(every) and every >= 1:
            c.map(p + "save_top_k", {"checkpoint.keep_every": every}, "-1 = keep all: keep every multiple of "
                                                                      "every_n_train_steps")
        else:
            c.unmap(p + "save_top_k", "plait keeps at least the newest checkpoint (checkpoint.keep >= 1)")
    resume = c.get(e + "resume_from_checkpoint")
    if resume is not None:
        c.map(e + "resume_from_checkpoint", {"checkpoint.resume": resume},
              "an NxDT (xser) checkpoint is not readable by plait; point it at a plait checkpoint")
    elif c.has(e + "resume_from_checkpoint"):
        c.ignore(e + "resume_from_checkpoint", "null: no explicit checkpoint")
    if c.has(e + "resume_if_exists"):
        if resume is not None:
            c.ignore(e + "resume_if_exists", "exp_manager.resume_from_checkpoint names the checkpoint")
        else:
            c.map(e + "resume_if_exists", {"checkpoint.resume": "auto" if flag(c.get(e + "resume_if_exists"))
                                           else "none"})


# ---------------------------------------------------------------------- distributed_strategy
def import_strategy(c: Collector, world: int | None) -> int | None:
    """Maps ``distributed_strategy``; returns dp when the world size is known and divisible."""
    s = "distributed_strategy."
    for key, name in (("tensor_model_parallel_size", "parallel.tp"), ("pipeline_model_parallel_size", "parallel.pp"),
                      ("zero1", "parallel.zero1"), ("sequence_parallel", "parallel.sequence_parallel")):
        if c.has(s + key):
            c.map(s + key, {name: c.get(s + key)})
    vpp = c.get(s + "virtual_pipeline_model_parallel_size")
    if c.has(s + "virtual_pipeline_model_parallel_size"):
        if is_int(vpp) and vpp > 1:
            c.map(s + "virtual_pipeline_model_parallel_size", {"parallel.vpp": vpp,
                                                                "parallel.schedule": "interleaved-1f1b"})
        else:
            c.map(s + "virtual_pipeline_model_parallel_size", {"parallel.vpp": 1 if vpp is None else vpp})
    for key in ("kv_size_multiplier", "kv_replicator"):
        if c.has(s + key):
            c.map(s + key, {"parallel.kv_replication": c.get(s + key)},
                  "NxD copies each K/V head this many times; plait's kv_replication is the number of TP ranks "
                  "holding the same K/V heads, the same number when the copies land on distinct ranks")
    for key in ("expert_model_parallel_size", "context_parallel_size"):
        if not c.has(s + key):
            continue
        if c.get(s + key) == 1:
            c.ignore(s + key, "1 = off")
        elif key == "expert_model_parallel_size":
            c.map(s + key, {"parallel.ep": c.get(s + key)}, "expert parallelism folds over data parallelism "
                                                            "(docs/moe.md)")
        else:
            c.unmap(s + key, "not imported: set parallel.cp by hand (zigzag ring attention, "
                             "docs/context_parallel.md); the import derives dp over tp*pp only")
    tp, pp = c.value("parallel.tp", 1), c.value("parallel.pp", 1)
    if world is None or not (is_int(tp) and is_int(pp) and tp >= 1 and pp >= 1):
        return None
    if world % (tp * pp):
        c.unmap("trainer.devices", f"world size {world} is not a multiple of tp*pp = {tp * pp}; dp stays open",
                value=world)
        return None
    dp = world // (tp * pp)
    c.map("(trainer.devices*trainer.num_nodes)/(tp*pp)", {"parallel.dp": dp}, f"{world}/({tp}*{pp})", value=world)
    return dp


# ---------------------------------------------------------------------- data
def import_data(c: Collector, dp: int | None) -> None:
    d = "data."
    for key, name in (("micro_batch_size", "data.micro_batch_size"), ("seq_length", "data.seq_len")):
        if c.has(d + key):
            c.map(d + key, {name: c.get(d + key)})
    _global_batch(c, dp)
    if c.get(d + "train_dir") is not None:
        c.map(d + "train_dir", {"data.source": c.get(d + "train_dir")},
              "plait reads text/JSONL (the 'text' field) or its own prepared data: re-prepare a pre-tokenized "
              "NxDT dataset with `plait data prepare` from its source text")
    if c.has(d + "val_dir"):
        if c.get(d + "val_dir") is None:
            c.ignore(d + "val_dir", "not set")
        else:
            c.unmap(d + "val_dir", "plait holds out data.val_fraction of data.source for validation")
    tokenizer = c.get(d + "tokenizer.type", c.get(d + "tokenizer"))
    key = d + "tokenizer.type" if c.has(d + "tokenizer.type") else d + "tokenizer"
    if isinstance(tokenizer, str):
        path = tokenizer if tokenizer.endswith(".json") else f"{tokenizer.rstrip('/')}/tokenizer.json"
        c.map(key, {"data.tokenizer": path}, "plait loads a tokenizer.json file (a Hugging Face fast tokenizer)")
    if c.has(d + "dev_choose_samples"):
        if c.get(d + "dev_choose_samples") is None:
            c.ignore(d + "dev_choose_samples", "not set")
        else:
            c.unmap(d + "dev_choose_samples", "plait has no sample-subset option; prepare a smaller source")


def _global_batch(c: Collector, dp: int | None) -> None:
    key = "data.global_batch_size"
    if not c.has(key):
        return
    gbs, mbs = c.get(key), c.value("data.micro_batch_size", 1)
    if dp is None:
        c.unmap(key, "dp is unknown (trainer.devices/num_nodes not given): plait's global batch is "
                     "micro_batch_size*microbatches*dp; set parallel.microbatches = global_batch_size/(mbs*dp)")
        return
    if not (is_int(gbs) and is_int(mbs) and gbs >= 1 and mbs >= 1) or gbs % (mbs * dp):
        c.unmap(key, f"invalid for plait: must be a multiple of micro_batch_size*dp = {mbs}*{dp}; "
                     "plait's global batch is micro_batch_size*microbatches*dp")
        return
    c.map(key, {"parallel.microbatches": gbs // (mbs * dp), "data.global_batch_size": gbs},
          f"gradient accumulation = {gbs}/(micro_batch_size {mbs} * dp {dp})")
