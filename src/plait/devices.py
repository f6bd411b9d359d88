"""One table of accelerator facts, shared by MFU reporting now and memory/time planning later.

Each :class:`DeviceSpec` gives the dense (no structured sparsity) peak matmul throughput per
dtype, the device memory and the interconnect bandwidths, from the vendors' public data sheets
(cited next to each entry). The CPU has no data sheet worth trusting, so its peak is *measured*
once by a square matrix-multiply probe of the same dtype and cached on disk, keyed by CPU model,
thread count and torch version; a CUDA GPU that is not in the table is measured the same way.

Units: FLOP/s, bytes, bytes/s. ``intra_node_bw`` is the per-device scale-up bandwidth as the
vendor quotes it (NVLink figures are both directions summed; halve them for one direction);
``inter_node_bw`` is the per-device share of the scale-out network, one direction.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from plait.data.tokenizer import cache_dir

T = 1e12
GB = 1e9
GiB = 1024**3

#: accepted spellings of each dtype name used as a key of :attr:`DeviceSpec.peak_flops`
_DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "tf32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
}
_TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class DeviceError(ValueError):
    """An unknown device or dtype name, or a device without a peak for the dtype asked."""


@dataclass(frozen=True)
class DeviceSpec:
    """Facts about one accelerator (one GPU / one Trainium chip / one CPU socket set).

    Attributes:
        name: table key (``"h100"``, ``"cpu"``, ...).
        peak_flops: dense peak FLOP/s per dtype name (``"fp32"``, ``"bf16"``, ...); empty when
            ``measured`` (use :func:`peak_flops`, which runs and caches the probe).
        memory_bytes: device memory (vendor nominal; host RAM for ``"cpu"``); ``None`` if unknown.
        intra_node_bw: per-device scale-up bandwidth in bytes/s as quoted by the vendor.
        inter_node_bw: per-device scale-out bandwidth in bytes/s, one direction.
        host_link_bw: bandwidth between the device and its host's memory in bytes/s, one direction
            (what optimizer offload moves gradients and weights over); ``None`` if unknown.
        measured: peaks come from the matmul probe instead of the table.
        description: the marketing name, or the detected device name.
    """

    name: str
    peak_flops: dict[str, float] = field(default_factory=dict)
    memory_bytes: int | None = None
    intra_node_bw: float | None = None
    inter_node_bw: float | None = None
    host_link_bw: float | None = None
    measured: bool = False
    description: str = ""


#: gloo between processes of one host, one direction per rank: its collectives go over loopback
#: TCP, not shared memory. A ring all-reduce of 16-64 MiB fp32 buffers with one thread per rank
#: measured 0.91-0.97 GB/s of bus bandwidth on 2 and 4 ranks of a 2-core x86 host (torch 2.13);
#: 1 GB/s is the round, conservative figure. The table quotes intra-node links both directions
#: summed, so the CPU entry holds twice this.
CPU_LOOPBACK_BW = 1 * GB
#: gloo between hosts, one direction per rank: a 10 Gb/s Ethernet link (1.25 GB/s line rate) less
#: TCP overhead, assumed for each rank.
CPU_NETWORK_BW = 1 * GB

# Sources (checked 2025):
# * NVIDIA H100 Tensor Core GPU datasheet, SXM5 column: FP32 67 TFLOPS, TF32 989 / BF16 1,979 TFLOPS
#   "with sparsity" (dense = half: 494.7 / 989.4), 80 GB HBM3, NVLink 900 GB/s. DGX H100: eight
#   400 Gb/s ConnectX-7 ports, one per GPU -> 50 GB/s per GPU.
# * NVIDIA H200 Tensor Core GPU datasheet, SXM column: same compute as H100 SXM (FP32 67, BF16
#   1,979 sparse), 141 GB HBM3e, NVLink 900 GB/s; HGX H200 nodes use the same 400 Gb/s per GPU.
# * NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column: FP32 19.5 TFLOPS, TF32 156 and BF16
#   312 TFLOPS dense (312 / 624 with sparsity), 80 GB HBM2e, NVLink 600 GB/s. DGX A100: eight
#   200 Gb/s HDR InfiniBand ports, one per GPU -> 25 GB/s per GPU.
# * Host links: H100/H200 SXM attach to their host over PCIe Gen5 x16 (64 GB/s per direction), A100
#   SXM4 over PCIe Gen4 x16 (32 GB/s per direction); nominal rates, practical copies reach ~80% of them.
#   No host link figure is published for a Trainium chip: offload is not priced there.
# * AWS Neuron docs, "Trainium Architecture" and "Trn1/Trn1n Architecture": per chip 190
#   FP16/BF16/TF32 TFLOPS, 47.5 FP32 TFLOPS, 32 GiB HBM; "Trainium2 Architecture": inter-chip
#   interconnect 384 GB/s per Trainium chip; trn1.32xlarge has 800 Gbps EFA for 16 chips
#   -> 50 Gb/s = 6.25 GB/s per chip (trn1n: 1600 Gbps).
# * AWS Neuron docs, "Trainium2 Architecture": per chip 667 BF16/FP16/TF32 TFLOPS dense, 181 FP32
#   TFLOPS, 96 GiB HBM, NeuronLink-v3 1.28 TB/s per chip; trn2.48xlarge has 3.2 Tbps EFAv3 for
#   16 chips -> 200 Gb/s = 25 GB/s per chip.
DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec(
        "h100", {"fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T},
        memory_bytes=int(80 * GB), intra_node_bw=900 * GB, inter_node_bw=50 * GB, host_link_bw=64 * GB,
        description="NVIDIA H100 SXM5 80GB"),
    "h200": DeviceSpec(
        "h200", {"fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T},
        memory_bytes=int(141 * GB), intra_node_bw=900 * GB, inter_node_bw=50 * GB, host_link_bw=64 * GB,
        description="NVIDIA H200 SXM 141GB"),
    "a100": DeviceSpec(
        "a100", {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T},
        memory_bytes=int(80 * GB), intra_node_bw=600 * GB, inter_node_bw=25 * GB, host_link_bw=32 * GB,
        description="NVIDIA A100 SXM4 80GB"),
    "trn1": DeviceSpec(
        "trn1", {"fp32": 47.5 * T, "tf32": 190 * T, "bf16": 190 * T, "fp16": 190 * T},
        memory_bytes=32 * GiB, intra_node_bw=384 * GB, inter_node_bw=6.25 * GB,
        description="AWS Trainium (trn1), one chip = 2 NeuronCore-v2"),
    "trn2": DeviceSpec(
        "trn2", {"fp32": 181 * T, "tf32": 667 * T, "bf16": 667 * T, "fp16": 667 * T},
        memory_bytes=96 * GiB, intra_node_bw=1280 * GB, inter_node_bw=25 * GB,
        description="AWS Trainium2 (trn2), one chip = 8 NeuronCore-v3"),
    "cpu": DeviceSpec("cpu", measured=True, intra_node_bw=2 * CPU_LOOPBACK_BW, inter_node_bw=CPU_NETWORK_BW,
                      description="host CPU (peak measured by a matmul probe)"),
}

_ALIASES = {"h100-sxm": "h100", "h100_sxm": "h100", "h200-sxm": "h200", "a100-80gb": "a100",
            "a100-sxm": "a100", "trainium": "trn1", "trainium1": "trn1", "trainium2": "trn2"}

#: environment variable naming the device explicitly (e.g. on Trainium, which torch cannot see)
DEVICE_ENV = "PLAIT_DEVICE"
PROBE_SIZE = 2048
PROBE_REPS = 5
PROBE_BUDGET_S = 3.0


def canonical_dtype(dtype: str | torch.dtype) -> str:
    """Canonical dtype key (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``) of a name or torch dtype."""
    key = str(dtype).lower()
    if key not in _DTYPE_ALIASES:
        raise DeviceError(f"dtype {dtype!r} is not known; valid: {sorted(set(_DTYPE_ALIASES.values()))}")
    return _DTYPE_ALIASES[key]


def get_device(name: str) -> DeviceSpec:
    """The table entry called ``name`` (case-insensitive; ``"h100-sxm"``-style aliases accepted)."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in DEVICES:
        raise DeviceError(f"device {name!r} is not in the device table; valid: {sorted(DEVICES)}")
    spec = DEVICES[key]
    return _cpu_spec() if key == "cpu" else spec


def _cpu_spec() -> DeviceSpec:
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = None
    return dataclasses.replace(DEVICES["cpu"], memory_bytes=ram, description=f"{cpu_model()} (host CPU)")


def _match_cuda_name(gpu: str) -> str | None:
    """Table key of a CUDA device name, or ``None`` for a device whose peaks the table lacks."""
    g = gpu.upper()
    if "H200" in g:
        return "h200"
    if "H100" in g and "PCIE" not in g and "NVL" not in g:  # PCIe / NVL parts have lower clocks
        return "h100"
    if "A100" in g and "PCIE" not in g and "40GB" not in g:
        return "a100"
    return None


def detect_device(index: int | None = None) -> DeviceSpec:
    """The :class:`DeviceSpec` of this process's accelerator.

    ``$PLAIT_DEVICE`` names a table entry explicitly (needed on Trainium). Otherwise a CUDA
    device is matched by name (H200, H100 SXM, A100 SXM 80GB); a CUDA device the table does not
    know gets a measured spec (``measured=True``, named ``"cuda"``). Without CUDA it is ``"cpu"``.
    """
    override = os.environ.get(DEVICE_ENV)
    if override:
        return get_device(override)
    if torch.cuda.is_available():
        index = torch.cuda.current_device() if index is None else index
        gpu = torch.cuda.get_device_name(index)
        key = _match_cuda_name(gpu)
        if key is not None:
            return DEVICES[key]
        props = torch.cuda.get_device_properties(index)
        return DeviceSpec("cuda", memory_bytes=int(props.total_memory), measured=True, description=gpu)
    return _cpu_spec()


# ------------------------------------------------------------------------------ torch devices
def available_torch_devices() -> list[str]:
    """Devices this torch build can run on here: ``cpu``, then each device of every accelerator
    backend torch knows (``cuda:0``, ``mps``, ``xpu:0``, ...) that reports itself available."""
    found = ["cpu"]
    for kind in ("cuda", "xpu", "mps", "hpu", "mtia"):
        module = getattr(torch, kind, None) if kind != "mps" else getattr(torch.backends, "mps", None)
        try:
            if module is None or not module.is_available():
                continue
            count = module.device_count() if hasattr(module, "device_count") else 1
        except (RuntimeError, AssertionError, AttributeError):  # a backend compiled in but unusable
            continue
        found += [kind] if kind == "mps" else [f"{kind}:{i}" for i in range(count)]
    return found


def usable_torch_device(name: str) -> torch.device:
    """``torch.device(name)`` if this build can run on it here, else :class:`DeviceError` naming
    the device and the available ones (a CPU-only build has ``cuda`` in its vocabulary but no
    CUDA, and ``torch.device`` alone accepts any known device type)."""
    available = available_torch_devices()
    hint = f"available here: {', '.join(available)} (torch {torch.__version__})"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise DeviceError(f"device {name!r} is not a torch device name; {hint}") from None
    if device.type == "cpu" and device.index in (None, 0):
        return device
    wanted = str(device) if device.index is not None else device.type
    if any(a == wanted or a.split(":")[0] == wanted for a in available):
        return device
    raise DeviceError(f"device {name!r} is not available in this build on this machine; {hint}")


# ------------------------------------------------------------------------------ measured peaks
@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), falling back to :mod:`platform`."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def cache_file() -> Path:
    return cache_dir() / "device_peaks.json"


def _probe_key(spec: DeviceSpec, dtype: str, threads: int) -> str:
    if spec.name == "cpu":
        return f"cpu|{cpu_model()}|threads={threads}|torch={torch.__version__}|{dtype}"
    precision = torch.get_float32_matmul_precision() if dtype == "fp32" else "-"
    return f"{spec.name}|{spec.description}|torch={torch.__version__}|{dtype}|fp32_precision={precision}"


def measure_matmul_flops(dtype: str, *, device: str = "cpu", threads: int | None = None,
                         n: int = PROBE_SIZE, reps: int = PROBE_REPS, budget_s: float = PROBE_BUDGET_S) -> float:
    """Best-of-``reps`` FLOP/s of an ``n x n`` by ``n x n`` matmul in ``dtype`` on ``device``.

    One warm-up product first; stops early once ``budget_s`` seconds of timed products have run.
    On the CPU the product runs with ``threads`` intra-op threads (restored afterwards).
    """
    tdtype = _TORCH_DTYPES[canonical_dtype(dtype)]
    old_threads = torch.get_num_threads()
    if threads is not None and device == "cpu":
        torch.set_num_threads(threads)
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        a = torch.randn(n, n, generator=gen).to(device=device, dtype=tdtype)
        b = torch.randn(n, n, generator=gen).to(device=device, dtype=tdtype)
        sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
        torch.mm(a, b)
        sync()
        best, spent = float("inf"), 0.0
        for _ in range(max(1, reps)):
            start = time.perf_counter()
            torch.mm(a, b)
            sync()
            elapsed = time.perf_counter() - start
            best, spent = min(best, elapsed), spent + elapsed
            if spent > budget_s:
                break
    finally:
        torch.set_num_threads(old_threads)
    return 2 * n**3 / best


def _read_cache(path: Path) -> dict[str, float]:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _measured_peak(spec: DeviceSpec, dtype: str, threads: int) -> float:
    path = cache_file()
    key = _probe_key(spec, dtype, threads)
    cached = _read_cache(path)
    if isinstance(cached.get(key), (int, float)) and cached[key] > 0:
        return float(cached[key])
    device = "cuda" if spec.name == "cuda" else "cpu"
    value = measure_matmul_flops(dtype, device=device, threads=threads)
    cached = _read_cache(path)  # another process may have added entries meanwhile
    cached[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:  # a read-only cache only costs a re-measurement next time
        pass
    return value


def peak_flops(device: DeviceSpec | str, dtype_name: str | torch.dtype = "bf16", threads: int | None = None) -> float:
    """Dense peak FLOP/s of ``device`` (a spec or a table name) for ``dtype_name`` (or a torch dtype).

    Table devices return the vendor figure. Measured devices (``"cpu"``, unknown CUDA GPUs) run
    the matmul probe once per (model, ``threads``, torch version, dtype) and cache the result in
    ``<plait cache>/device_peaks.json``; ``threads`` defaults to ``torch.get_num_threads()``.
    """
    spec = device if isinstance(device, DeviceSpec) else get_device(device)
    name = canonical_dtype(dtype_name)
    if not spec.measured:
        if name not in spec.peak_flops:
            raise DeviceError(f"device {spec.name!r} has no peak for dtype {name!r}; "
                              f"valid: {sorted(spec.peak_flops)}")
        return spec.peak_flops[name]
    if name == "tf32":
        name = "fp32"  # the probe runs under the current float32 matmul precision
    return _measured_peak(spec, name, threads or torch.get_num_threads())


__all__ = ["CPU_LOOPBACK_BW", "CPU_NETWORK_BW", "DEVICES", "DEVICE_ENV", "DeviceError", "DeviceSpec",
           "available_torch_devices", "cache_file", "canonical_dtype", "cpu_model", "detect_device", "get_device",
           "measure_matmul_flops", "peak_flops", "usable_torch_device"]
