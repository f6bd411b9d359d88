"""Batches for one DP rank, built by a background thread a few steps ahead of the training loop.

``BatchLoader`` yields, step after step, a ``[microbatches, micro_batch_size, seq_len]`` int64
tensor holding this rank's share of the global batch chosen by a ``GlobalBatchSampler``. A thread
builds them at most ``prefetch`` steps ahead of the consumer; an exception in the thread is raised
again in the consumer at the step it belongs to. ``wait_seconds`` accumulates the time the
consumer was blocked waiting for a batch, so a trainer can report the share of a step spent
waiting for data.
"""

from __future__ import annotations

import functools
import queue
import threading
import time

import torch

from plait.data.batch import TokenBatch
from plait.data.sampler import GlobalBatchSampler
from plait.data.sft_prepare import RowDataset

_END = object()


class _Failure:
    def __init__(self, step: int, exc: BaseException):
        self.step, self.exc = step, exc


def _build_batch(dataset, sampler: GlobalBatchSampler, dp_rank: int, dp: int, microbatches: int, pin: bool,
                 step: int) -> torch.Tensor | TokenBatch:
    flat = [i for mb in sampler.rank_indices(step, dp_rank, dp, microbatches) for i in mb]
    if isinstance(dataset, RowDataset):  # fine-tuning rows: labels, packed layout, the global target count
        batch = dataset.token_batch(flat, sampler.indices(step), microbatches)
        return batch.pin_memory() if pin else batch
    if hasattr(dataset, "batch"):  # TokenDataset reads all samples straight into one array
        data = dataset.batch(flat)
    else:
        data = torch.stack([torch.as_tensor(dataset[i]) for i in flat])
    data = data.to(torch.int64).reshape(microbatches, len(flat) // microbatches, -1)
    return data.pin_memory() if pin else data


def _work(build, step: int, end: int | None, out: queue.Queue, slots: threading.Semaphore,
          stop: threading.Event) -> None:
    try:
        while end is None or step < end:
            while not slots.acquire(timeout=0.05):
                if stop.is_set():
                    return
            if stop.is_set():
                return
            out.put((step, build(step)))
            step += 1
        out.put(_END)
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer
        out.put(_Failure(step, exc))


class BatchLoader:
    """Iterator over steps ``start_step, start_step + 1, ...`` of one DP rank's batches.

    Endless unless ``num_steps`` is given. ``step`` is the step the next batch belongs to (what to
    save in a checkpoint). ``pin_memory`` defaults to whether CUDA is available. Use as a context
    manager or call ``close()`` to stop the thread.
    """

    def __init__(self, dataset, sampler: GlobalBatchSampler, *, dp_rank: int, dp: int, microbatches: int,
                 start_step: int = 0, prefetch: int = 2, pin_memory: bool | None = None,
                 num_steps: int | None = None):
        if not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"prefetch={prefetch!r} must be a positive integer")
        if not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step={start_step!r} must be a non-negative integer")
        if num_steps is not None and (not isinstance(num_steps, int) or num_steps < 0):
            raise ValueError(f"num_steps={num_steps!r} must be a non-negative integer or None")
        if sampler.num_samples > len(dataset):
            raise ValueError(f"the sampler draws from {sampler.num_samples} samples but the dataset has only "
                             f"{len(dataset)}")
        sampler.rank_indices(start_step, dp_rank, dp, microbatches)  # validates dp_rank, dp, microbatches
        self.dataset, self.sampler = dataset, sampler
        self.dp_rank, self.dp, self.microbatches = dp_rank, dp, microbatches
        self.micro_batch_size = sampler.global_batch_size // (dp * microbatches)
        self.start_step, self.prefetch, self.num_steps = start_step, prefetch, num_steps
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.step = start_step
        self.wait_seconds = 0.0
        self._queue: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(prefetch)  # one per batch built and not yet taken
        self._stop = threading.Event()
        self._done = False
        self._error: BaseException | None = None
        build = functools.partial(_build_batch, dataset, sampler, dp_rank, dp, microbatches, self.pin_memory)
        end = None if num_steps is None else start_step + num_steps
        # The thread holds no reference to ``self``, so an unclosed loader is still collected (and stops it).
        self._thread = threading.Thread(target=_work,
                                        args=(build, start_step, end, self._queue, self._slots, self._stop),
                                        name=f"plait-batch-loader-dp{dp_rank}", daemon=True)
        self._thread.start()

    def build(self, step: int) -> torch.Tensor | TokenBatch:
        """The batch of ``step`` (computed in the calling thread)."""
        return _build_batch(self.dataset, self.sampler, self.dp_rank, self.dp, self.microbatches, self.pin_memory, step)

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> torch.Tensor | TokenBatch:
        if self._error is not None:
            raise self._error
        if self._done:
            raise StopIteration
        if self._stop.is_set():
            raise RuntimeError("BatchLoader is closed")
        start = time.perf_counter()
        try:
            while True:
                try:
                    item = self._queue.get(timeout=0.5)
                    break
                except queue.Empty:
                    if not self._thread.is_alive() and self._queue.empty():
                        raise RuntimeError("the BatchLoader thread exited without a batch") from None
        finally:
            self.wait_seconds += time.perf_counter() - start
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._error = item.exc
            if hasattr(item.exc, "add_note"):
                item.exc.add_note(f"(raised in the BatchLoader thread of dp rank {self.dp_rank} "
                                  f"while building step {item.step})")
            raise item.exc
        step, batch = item
        assert step == self.step, (step, self.step)
        self._slots.release()
        self.step += 1
        return batch

    def close(self) -> None:
        """Stops the thread (it finishes the batch it is building) and drops prefetched batches."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
