"""How a run writes its final model: a whole Hugging Face checkpoint, or a LoRA adapter.

Both are :class:`~plait.train.plugins.FinalExport` objects chosen by
:func:`plait.train.build_run.build_run` (``lora.rank`` set: the adapter), collective over every
rank, and never gather a whole model on one rank under any layout.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from plait.checkpoint.convert import plait_to_hf
from plait.checkpoint.format import step_dir_name
from plait.checkpoint.store import latest_checkpoint
from plait.checkpoint.writer import CheckpointWriter
from plait.data.tokenizer_files import TOKENIZER_FILE, copy_model_use_files, model_use_files
from plait.lora import save_peft_adapter
from plait.lora.peft_io import BASE_SUBDIR
from plait.materialize import build_model
from plait.mesh import single_process_mesh
from plait.models.hf_io import write_local_model
from plait.quantize import QUANTIZATION_FILE, BaseQuantization
from plait.train.checkpointing import RunCheckpoints
from plait.train.plugins import FinalExport
from plait.train.run_state import RunState

#: size cap of one file of the final Hugging Face checkpoint (Hugging Face's own default)
FINAL_SHARD_BYTES = 5 * 1024**3
#: where the final model's checkpoint is written when the run keeps none (removed after conversion)
FINAL_EXPORT_DIR = ".plait-final-export"


def model_use_sources(state: RunState) -> tuple[Path, str | None]:
    """Where the files describing the model's use come from: the prepared data's tokenizer (the
    one trained with, with its chat template), then ``model.hf_path`` (its generation_config.json)."""
    data = state.train_data
    return data.directory / data.index.get("tokenizer", TOKENIZER_FILE), state.recipe.model.hf_path


def run_model_use_files(state: RunState) -> dict[str, Path]:
    return model_use_files(*model_use_sources(state))


class FullModelExport(FinalExport):
    """The final Hugging Face model, written through the sharded checkpoint of the last step.

    Every stage writes its own shard and rank 0 converts the checkpoint tensor by tensor, so no
    rank ever holds the whole model, under any layout. The run's own checkpoint of that step is
    used when ``save_every`` wrote one; otherwise a private one is written under the save
    directory (``.plait-final-export``) and removed after the conversion, so a run that asked
    for no checkpoints leaves none (and can simply be run again).
    """

    what = "Hugging Face checkpoint"

    def __init__(self, state: RunState, checkpoints: RunCheckpoints) -> None:
        self.state, self.checkpoints = state, checkpoints

    def export(self, step: int) -> None:
        st, resolved = self.state, self.state.resolved
        self.checkpoints.finish()
        source = latest_checkpoint(resolved.save_dir)
        export = None
        if source is None or source.name != step_dir_name(step):
            export = Path(resolved.save_dir) / FINAL_EXPORT_DIR
            writer = CheckpointWriter(export, rank=st.rank, world=st.world, keep=1)
            self.checkpoints.save(step, sync=True, writer=writer)
            writer.wait()
            if st.world > 1:
                dist.barrier(group=st.control)
            source = latest_checkpoint(export)
        if st.rank == 0:
            if source is None:  # rank 0 committed it above; only the writer reads it back
                raise RuntimeError(f"the final export checkpoint of step {step} is not complete in {export}")
            plait_to_hf(source, resolved.checkpoint_dir, progress=False, overwrite=True,  # checked before launch
                        max_shard_bytes=FINAL_SHARD_BYTES)
            if export is not None:
                shutil.rmtree(export, ignore_errors=True)


class AdapterExport(FinalExport):
    """A LoRA run's final model: its adapter in the PEFT layout (``adapter_config.json`` and
    ``adapter_model.safetensors``), loadable by ``peft`` onto ``model.hf_path``: the base weights
    did not change. Gathered over TP and the pipeline; global rank 0 writes.

    A random base (no ``model.hf_path``) exists nowhere else: it is written inside the adapter
    directory (``base/``), and the adapter names it, so the adapter stays usable.
    """

    what = "LoRA adapter (PEFT layout)"

    def __init__(self, state: RunState, checkpoints: RunCheckpoints) -> None:
        self.state, self.checkpoints = state, checkpoints

    def export(self, step: int) -> None:  # noqa: ARG002 - the adapter is the live one, of the last step
        st, r = self.state, self.state.recipe
        self.checkpoints.finish()
        final = Path(st.resolved.checkpoint_dir)
        base = r.model.hf_path if r.model.hf_path is not None else str((final / BASE_SUBDIR).absolute())
        writer = st.rank == 0
        lo = r.lora
        with tempfile.TemporaryDirectory() as scratch, st.optimizer.weights_gathered():  # ZeRO-3: adapters' chunks
            extra = run_model_use_files(st) if writer else None
            if extra is not None and lo.quantized:  # the base it learned on, beside the adapter
                rounded = "bfloat16" if st.policy.param_dtype == torch.bfloat16 else "float32"
                extra[QUANTIZATION_FILE] = BaseQuantization(lo.quantize_base, lo.quantize_block_size,
                                                            rounded).write(Path(scratch))
            save_peft_adapter(st.stages, final, st.tp, base, pp=st.pp,
                              replace=True,  # checked before launch, as for the full model
                              extra_files=extra)
        if r.model.hf_path is None and writer:
            self._write_random_base(final / BASE_SUBDIR)
        if st.world > 1:
            dist.barrier(group=st.control)

    def _write_random_base(self, directory: Path) -> None:
        """The layout-invariant initialisation of ``run.seed`` (each weight a function of the seed
        and its name), rebuilt whole in this one process and written as a Hugging Face directory."""
        st = self.state
        model = build_model(st.config, single_process_mesh(), seed=st.recipe.run.seed, dtype=st.policy.param_dtype)
        sources = model_use_sources(st)
        write_local_model(model, directory, max_shard_bytes=FINAL_SHARD_BYTES,
                          extra_files=[("model use files", lambda d: copy_model_use_files(d, *sources))])
