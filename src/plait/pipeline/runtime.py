"""Executes a rank's pipeline schedule: forward/backward of its stages and point-to-point transfers.

The schedule (:mod:`plait.pipeline.schedules`) is a list of typed tasks; this runtime only
carries them out. Sends are non-blocking (their handles are waited on at the end of the step),
receives block, which is deadlock-free for any schedule whose task order respects the data
dependencies (the schedules are checked by a simulator with exactly these semantics).

Shapes and dtypes of the tensors that cross stages are fixed once, at construction, from the
micro-batch shape: ``[micro_batch, seq_len / tp (sequence parallel) or seq_len, hidden]``.
An activation is dropped as soon as its backward has run. A sent activation's buffer is released
when the matching gradient comes back (the send is then known to be complete; gloo reports a send
complete only once it is waited on), so at most the schedule's in-flight microbatches are held.
Sent input gradients are still kept until the end of the step.

Receives are pre-posted (gloo): the runtime keeps the next ``prepost_receives`` receives of its
task list posted as ``irecv`` ahead of the tasks that consume them, so a message arrives while the
rank computes instead of after it reaches the receive (gloo moves data only once the receiver has
posted its buffer). The order in which receives are *waited on* is the task list's, so a schedule
that is deadlock-free with blocking receives stays so. On backends that serialise a pair's
point-to-point operations on one stream (NCCL), an early receive could hold back a send the peer
needs first, so there receives stay blocking at their place in the list. Receive buffers come
from a pool kept across steps and go back to it only once every task of their (microbatch,
chunk) has run: after the last ``SendGradient``/``Backward`` and, with a split backward, the
``WeightGrad``, whose deferred products may hold the received tensors themselves (the output
gradient of a stage's last projection *is* the received gradient).

Zero-bubble schedules (``zb-h1``) split each backward: the runtime attaches a
:class:`~plait.tensor_parallel.weight_grad.WeightGradQueue` to the stages' column/row-parallel
layers, runs each ``Backward`` (B) inside ``queue.collect((microbatch, chunk))`` so those layers
defer their weight-gradient products, and each ``WeightGrad`` (W) task runs them. The
data-parallel "last gradient" marking follows: with ``mark_final_params`` set, a stage's other
parameters are marked before its last B and the deferred weights before its last W; without it,
``before_last_backward(chunk)`` is called before the stage's last W (correct, but buckets whose
parameters all got their last gradient in B then start only in the final flush).

Whatever a feature plugs in (the data-parallel markers, a sequence-level loss head, a reference
model's pass, context parallelism's batch split) comes in one :class:`~plait.pipeline.hooks.RuntimeHooks`
given at construction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from plait.data.batch import TokenBatch, as_token_batch
from plait.mesh import ParallelMesh
from plait.pipeline import tasks as T
from plait.pipeline.hooks import RuntimeHooks
from plait.pipeline.schedules import SPLIT_BACKWARD_SCHEDULES, schedule_tasks
from plait.tensor_parallel.weight_grad import WeightGradQueue
from plait.tensor_parallel.weight_grad_attach import attach_weight_grad_queue


@dataclass
class _InFlight:
    """What a forward leaves for its backward."""

    inputs: torch.Tensor | None = None
    output: torch.Tensor | None = None
    output_grad: torch.Tensor | None = None


class PipelineRuntime:
    """Runs one rank's stages through its schedule; ``hooks``: what the run plugs in (see
    :class:`~plait.pipeline.hooks.RuntimeHooks`). ``precision_context()``: entered around every
    forward (autocast for a mixed-precision preset)."""

    def __init__(self, stages: list[nn.Module], mesh: ParallelMesh, *, schedule: str, microbatches: int,
                 micro_batch_size: int, seq_len: int, hidden_size: int, sequence_parallel: bool,
                 dtype: torch.dtype, precision_context: Callable[[], AbstractContextManager[object]] | None = None,
                 hooks: RuntimeHooks | None = None) -> None:
        self.stages, self.mesh = stages, mesh
        self.pp, self.rank = mesh.pp, mesh.pp_rank
        self.vpp = len(stages)
        self.num_stages = self.pp * self.vpp
        self.microbatches, self.schedule = microbatches, schedule
        self.tasks: list[T.Task] = []
        self.pp_ranks = mesh.my_group_ranks("pp")
        self.pp_group = mesh.group("pp") if self.pp > 1 else None
        local_seq = seq_len // mesh.tp if sequence_parallel and mesh.tp > 1 else seq_len
        self.act_shape = (micro_batch_size, local_seq, hidden_size)  # agreed once, for every transfer
        self.seq_len, self.dtype = seq_len, dtype
        self.device = next(stages[0].parameters()).device
        self.precision_context = precision_context
        #: what the run plugs in; replaced as a whole, never patched field by field
        self.hooks = hooks if hooks is not None else RuntimeHooks()
        self.use_tasks(schedule_tasks(schedule, self.rank, self.pp, microbatches, self.vpp))
        #: the deferred weight-gradient products of a split-backward schedule (``None`` otherwise)
        self.weight_grads: WeightGradQueue | None = None
        self._deferred: list[list[torch.Tensor]] = [[] for _ in stages]
        if schedule in SPLIT_BACKWARD_SCHEDULES:
            self.weight_grads = WeightGradQueue()
            self._deferred = [attach_weight_grad_queue(stage, self.weight_grads) for stage in stages]
        #: receives kept posted ahead of the tasks that wait on them (0: each receive blocks at its
        #: place in the list); only for gloo, see the module doc
        backend = dist.get_backend(self.pp_group) if self.pp_group is not None else ""
        self.prepost_receives = 2 if backend == "gloo" else 0
        #: free receive buffers (all of ``act_shape`` and ``dtype``), reused across micro-batches and steps
        self._pool: list[torch.Tensor] = []
        #: ``False``: a fresh buffer for every receive (the behaviour before pooling, for comparisons)
        self.reuse_receive_buffers = True

    def use_tasks(self, tasks: list[T.Task]) -> None:
        """Run ``tasks`` instead of the schedule's list (the same kinds of task; for tests and tools)."""
        self.tasks = tasks
        self._last_backward = {t.chunk: i for i, t in enumerate(tasks) if isinstance(t, T.Backward)}
        self._last_weight_grad = {t.chunk: i for i, t in enumerate(tasks) if isinstance(t, T.WeightGrad)}

    # ------------------------------------------------------------------ topology
    def _global_stage(self, chunk: int) -> int:
        return chunk * self.pp + self.rank

    def _peer(self, stage: int) -> int:
        return self.pp_ranks[stage % self.pp]

    def _tag(self, kind: int, microbatch: int, stage: int) -> int:
        """A message's tag: activation (0) or gradient (1), microbatch, and the *receiving* stage."""
        return (microbatch * self.num_stages + stage) * 2 + kind

    # ------------------------------------------------------------------ execution
    def _context(self) -> AbstractContextManager[object]:
        return self.precision_context() if self.precision_context else contextlib.nullcontext()

    def loss_normalizer(self, batch: TokenBatch) -> float | None:
        """The divisor of a micro-batch's summed token losses such that, after the runtime's
        division by the micro-batch count and the data-parallel average, the step's loss is the
        sum over the global batch divided by its target tokens (``None``: per-micro-batch means)."""
        if batch.loss_tokens is None:
            return None
        return max(batch.loss_tokens, 1) / (self.microbatches * self.mesh.info("dp").size)

    def run(self, batch: torch.Tensor | TokenBatch, *, train: bool = True) -> torch.Tensor:
        """Run one step's schedule over ``batch`` (``[microbatches, micro_batch, seq]`` ids, or a
        :class:`~plait.data.batch.TokenBatch` with labels and a packed layout).

        Training: gradients accumulate in the stages' parameters (loss of each microbatch divided
        by the number of microbatches). Returns the device-side loss sum of the last stage's
        microbatches (already divided by the microbatch count), zero on other ranks. With a
        ``reference_pass`` it runs over the batch first (training and evaluation alike).
        """
        tokens = as_token_batch(batch).to(self.device)
        if self.hooks.split_batch is not None:
            tokens = self.hooks.split_batch(tokens)
        if self.hooks.reference_pass is not None:
            self.hooks.reference_pass(self, tokens)
        return self.execute(tokens, train=train)

    def execute(self, tokens: TokenBatch, *, train: bool) -> torch.Tensor:
        """The schedule over ``tokens`` (on the device), without the reference pass: see :meth:`run`."""
        ids = tokens.input_ids
        head = self.hooks.loss_head
        normalizer = None if head is not None else self.loss_normalizer(tokens)
        m = self.microbatches
        loss_sum = torch.zeros((), device=self.device)
        state: dict[tuple[int, int], _InFlight] = {}
        received: dict[tuple[int, int], torch.Tensor] = {}
        #: sent gradients' handles and the tensors they read, kept until the end of the step
        pending_sends: list[dist.Work | None] = []
        sent_grads: list[torch.Tensor] = []
        act_sends: dict[tuple[int, int], tuple[dist.Work | None, torch.Tensor]] = {}
        tasks = self.tasks if train else self._forward_only_tasks()
        receives = _Receives(self, list(tasks), train)
        for index, task in enumerate(tasks):
            if isinstance(task, T.ReduceGradients):
                continue
            key = (task.microbatch, task.chunk)
            stage_id = self._global_stage(task.chunk)
            if isinstance(task, T.RecvActivation):
                received[key] = receives.take(index)
            elif isinstance(task, T.Forward):
                stage = self.stages[task.chunk]
                x = ids[task.microbatch] if stage.first else received.pop(key)
                if train and not stage.first:
                    x.requires_grad_()
                kw = tokens.stage_inputs(task.microbatch, last=bool(stage.last), normalizer=normalizer)
                if stage.last and head is not None:
                    kw["sequence_loss"] = head.bind(tokens, task.microbatch, train)
                with torch.set_grad_enabled(train), self._context():
                    out = stage(x, self.seq_len, **kw)
                if stage.last:
                    out = out / m
                    loss_sum = loss_sum + out.detach().float()
                state[key] = _InFlight(inputs=None if stage.first else x, output=out)
            elif isinstance(task, T.SendActivation):
                output = state[key].output
                assert output is not None, "a SendActivation follows its Forward"
                out = output.detach()
                if not train:
                    state.pop(key)
                work = dist.isend(out.contiguous(), dst=self._peer(stage_id + 1), group=self.pp_group,
                                  tag=self._tag(0, task.microbatch, stage_id + 1))
                act_sends[key] = (work, out)
            elif isinstance(task, T.RecvGradient):
                state[key].output_grad = receives.take(index)
                # The gradient exists only because the next stage received this activation, so the
                # send is complete: wait (returns at once) and release the sent buffer now.
                sent = act_sends.pop(key, None)
                if sent is not None and sent[0] is not None:
                    sent[0].wait()
            elif isinstance(task, T.Backward):
                st = state[key]
                assert st.output is not None, "a Backward follows its Forward and runs once"
                if self._last_backward[task.chunk] == index:
                    self._before_last(task.chunk, weights=False)
                with self.weight_grads.collect(key) if self.weight_grads else contextlib.nullcontext():
                    if self.stages[task.chunk].last:
                        st.output.backward()
                    else:
                        torch.autograd.backward(st.output, grad_tensors=st.output_grad)
                st.output, st.output_grad = None, None  # activations released after their backward
                if st.inputs is None:
                    state.pop(key)
            elif isinstance(task, T.WeightGrad):
                assert self.weight_grads is not None, "WeightGrad tasks come only with a split-backward schedule"
                if self._last_weight_grad[task.chunk] == index:
                    self._before_last(task.chunk, weights=True)
                self.weight_grads.run(key)
            elif isinstance(task, T.SendGradient):
                st = state.pop(key)
                assert st.inputs is not None, "a SendGradient is never on the first stage, whose input is ids"
                input_grad = st.inputs.grad
                assert input_grad is not None, "a SendGradient follows the Backward that fills its input's grad"
                grad = input_grad.contiguous()
                pending_sends.append(dist.isend(grad, dst=self._peer(stage_id - 1), group=self.pp_group,
                                                tag=self._tag(1, task.microbatch, stage_id - 1)))
                sent_grads.append(grad)
            receives.task_done(index, key)
        receives.finish()
        if self.weight_grads is not None and (left := self.weight_grads.pending()):
            raise RuntimeError(f"the schedule left deferred weight gradients unrun: {left}")
        for work, _ in act_sends.values():  # evaluation (no gradients come back) and the last sends
            if work is not None:
                work.wait()
        for work in pending_sends:
            if work is not None:
                work.wait()
        return loss_sum

    def _before_last(self, chunk: int, *, weights: bool) -> None:
        """Tell the data-parallel side that ``chunk``'s last gradients come next: before the last
        Backward (``weights=False``) or, with a split backward, before the last WeightGrad."""
        split = self.weight_grads is not None
        hooks = self.hooks
        if split and hooks.mark_final_params is not None:
            deferred = {id(p) for p in self._deferred[chunk]}
            params = [p for p in self.stages[chunk].parameters() if (id(p) in deferred) == weights]
            hooks.mark_final_params(params)
        elif hooks.before_last_backward is not None and weights == split:
            hooks.before_last_backward(chunk)

    def _post_receive(self, task: T.RecvActivation | T.RecvGradient) -> tuple[dist.Work | None, torch.Tensor]:
        """Issue ``task``'s receive into a pooled buffer: ``(work, buffer)``."""
        buf = self._pool.pop() if self._pool else torch.empty(self.act_shape, dtype=self.dtype, device=self.device)
        stage = self._global_stage(task.chunk)
        grad = isinstance(task, T.RecvGradient)
        work = dist.irecv(buf, src=self._peer(stage + 1 if grad else stage - 1), group=self.pp_group,
                          tag=self._tag(int(grad), task.microbatch, stage))
        return work, buf

    def _forward_only_tasks(self) -> list[T.Task]:
        """Forward-only order for evaluation: microbatch by microbatch, chunk by chunk."""
        out: list[T.Task] = []
        for mb in range(self.microbatches):
            for chunk in range(self.vpp):
                s = self._global_stage(chunk)
                if s > 0:
                    out.append(T.RecvActivation(mb, chunk))
                out.append(T.Forward(mb, chunk))
                if s < self.num_stages - 1:
                    out.append(T.SendActivation(mb, chunk))
        return out


class _Receives:
    """One step's receives: posted ``runtime.prepost_receives`` ahead in task-list order, waited on
    at their own task, their buffers returned to the runtime's pool after the last task of their
    (microbatch, chunk) in training (evaluation drops them: a forward-only stage may send a view
    of its input)."""

    def __init__(self, runtime: PipelineRuntime, tasks: list[T.Task], train: bool) -> None:
        self.runtime, self.tasks, self.train = runtime, tasks, train
        self.order = [i for i, t in enumerate(tasks) if isinstance(t, T.RECV_TASKS)]
        self.next = 0  # position in ``order`` of the first receive not yet posted
        self.posted: dict[int, tuple[dist.Work | None, torch.Tensor]] = {}
        self.held: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.last: dict[tuple[int, int], int] = {}
        if train:
            for i, t in enumerate(tasks):
                if not isinstance(t, T.ReduceGradients):
                    self.last[(t.microbatch, t.chunk)] = i
        self._post_ahead()

    def _post_ahead(self) -> None:
        while self.next < len(self.order) and len(self.posted) < self.runtime.prepost_receives:
            self._post(self.order[self.next])

    def _post(self, index: int) -> None:
        task = self.tasks[index]
        assert isinstance(task, T.RECV_TASKS)
        self.posted[index] = self.runtime._post_receive(task)
        self.next += 1

    def take(self, index: int) -> torch.Tensor:
        """The received tensor of the receive task at ``index`` (waits for it)."""
        while index not in self.posted:  # not pre-posted (depth 0, or the window is behind)
            self._post(self.order[self.next])
        work, buf = self.posted.pop(index)
        if work is not None:
            work.wait()
        self._post_ahead()
        if self.train:
            task = self.tasks[index]
            assert isinstance(task, T.RECV_TASKS)
            self.held.setdefault((task.microbatch, task.chunk), []).append(buf)
        return buf

    def task_done(self, index: int, key: tuple[int, int]) -> None:
        """After task ``index``: when it was the last of ``key``, its buffers are free again."""
        if self.last.get(key) == index and key in self.held:
            held = self.held.pop(key)
            if self.runtime.reuse_receive_buffers:
                self.runtime._pool.extend(b.detach() for b in held)

    def finish(self) -> None:
        assert not self.posted, f"receives posted but never waited on: {sorted(self.posted)}"
