"""Find the device-to-host reads inside training steps, with the Python stack of each.

A training step that reads a device value on the host (``loss.item()``, ``if torch.isnan(x):``,
``tensor.tolist()``) makes the host wait for the device, so the host can no longer queue the next
kernels while the device works. plait's steps do no such read (tests/test_trainer.py counts); a
user's loss head, callback or model change may add one. :class:`HostSyncDetector` wraps the
first few steps of a run and reports every read with the stack that made it:

* on CUDA, under ``torch.cuda.set_sync_debug_mode("warn")``: PyTorch itself flags every
  synchronising operation (including ones no Python method names, e.g. a boolean-mask index or
  ``nonzero``), as a warning whose Python stack is recorded here;
* on the CPU there is no device to wait for, so the same places are found by counting the calls
  that would read a device tensor: ``Tensor.item``, ``.tolist``, ``.cpu``, ``.numpy`` and the
  conversions ``bool()``, ``float()``, ``int()`` of a tensor, made on the step's thread.

Usage (what the trainer does with ``train.detect_host_syncs: true``)::

    detector = HostSyncDetector(device, steps=3)
    for step, batch in enumerate(batches):
        with detector.step(step):
            trainer.run_step(batch)
    print(detector.report())
"""

from __future__ import annotations

import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TextIO

import torch

#: Tensor methods that read a (device) tensor's values into host memory
HOST_READ_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


@dataclass(frozen=True)
class HostRead:
    """One read inside a step: which call, and the Python stack that made it (innermost last)."""

    step: int
    what: str
    stack: tuple[str, ...]

    def format(self) -> str:
        return f"step {self.step}: {self.what}\n" + "".join(self.stack)


def _user_stack() -> tuple[str, ...]:
    """The caller's stack without this module's and the warnings machinery's frames."""
    frames = [f for f in traceback.extract_stack()[:-1]
              if f.filename != __file__ and not f.filename.endswith(("warnings.py", "contextlib.py"))]
    return tuple(traceback.format_list(frames))


class _MethodCounter:
    """Wraps :data:`HOST_READ_METHODS` on ``torch.Tensor`` while active; records calls from one thread."""

    def __init__(self, record: Callable[[str], None]) -> None:
        self.record = record
        self.thread = threading.get_ident()
        self._orig: dict[str, Callable[..., Any]] = {}
        self._inside = False

    def __enter__(self) -> _MethodCounter:
        for name in HOST_READ_METHODS:
            orig = getattr(torch.Tensor, name)
            self._orig[name] = orig

            def wrapper(t: torch.Tensor, *a: Any, _orig: Callable[..., Any] = orig, _name: str = name,
                        **k: Any) -> Any:
                # the first read only: .item() of a CUDA tensor may call other wrapped methods
                if threading.get_ident() == self.thread and not self._inside:
                    self._inside = True
                    try:
                        self.record(f"Tensor.{_name}() of a {tuple(t.shape)} {t.dtype} tensor on {t.device}")
                        return _orig(t, *a, **k)
                    finally:
                        self._inside = False
                return _orig(t, *a, **k)

            setattr(torch.Tensor, name, wrapper)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, orig in self._orig.items():
            setattr(torch.Tensor, name, orig)
        self._orig.clear()


class HostSyncDetector:
    """Records the device-to-host reads of steps ``0 .. steps - 1`` (later steps run untouched);
    ``steps=0``: watches nothing (the run did not ask), so the loop needs no branch."""

    def __init__(self, device: torch.device, steps: int = 3) -> None:
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        self.device, self.steps = device, steps
        self.reads: list[HostRead] = []
        self.checked = 0

    @contextmanager
    def step(self, index: int) -> Iterator[None]:
        """Wrap one training step; only the first ``steps`` calls watch."""
        if self.checked >= self.steps:
            yield
            return
        self.checked += 1

        def record(what: str) -> None:
            self.reads.append(HostRead(index, what, _user_stack()))

        if self.device.type == "cuda":
            with self._cuda(record):
                yield
        else:
            with _MethodCounter(record):
                yield

    @contextmanager
    def _cuda(self, record: Callable[[str], None]) -> Iterator[None]:
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            shown = warnings.showwarning

            def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                     file: TextIO | None = None, line: str | None = None) -> None:
                if "synchroniz" in str(message):
                    record(str(message).splitlines()[0])
                else:
                    shown(message, category, filename, lineno, file, line)

            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(previous)
                warnings.showwarning = shown

    @property
    def done(self) -> bool:
        return self.checked >= self.steps

    def report(self) -> str:
        """A readable summary: none found, or each read with its stack."""
        how = "torch.cuda.set_sync_debug_mode" if self.device.type == "cuda" else "counting Tensor host reads"
        if not self.reads:
            return f"detect_host_syncs: no device-to-host read in the first {self.checked} step(s) ({how})"
        lines = [f"detect_host_syncs: {len(self.reads)} device-to-host read(s) in the first {self.checked} "
                 f"step(s) ({how}); each makes the host wait for the device:"]
        lines += [r.format() for r in self.reads]
        return "\n".join(lines)
