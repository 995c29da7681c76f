"""Devices by name: the present CPU or GPU, a capped CPU, or a catalog card.

    >>> from autofit.probe.device import resolve_device
    >>> d = resolve_device("cpu:4GiB")
    >>> d.capacity_bytes, d.allocator
    (4294967296, 'cpu')
    >>> resolve_device("H100-80GB").bf16
    True

Accepted names: ``auto`` (the present accelerator, else the CPU), ``cpu``,
``cpu:<size>`` (a CPU whose memory is capped: trials and tests without a GPU),
``cuda`` / ``cuda:N`` (probed live), and the names and aliases of the catalog
(``catalog.toml`` beside this file) for planning on a card that is not present.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from autofit.errors import UnknownDeviceError, fix

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["DeviceInfo", "resolve_device", "catalog", "parse_bytes", "format_bytes",
           "check_ranks_per_node", "MAX_RANKS_PER_NODE", "cpu_matmul_speed",
           "sm_version"]

MiB = 1 << 20
GiB = 1 << 30

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1000, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40,
}


def parse_bytes(text: str) -> int:
    """``"4GiB"`` -> 4294967296; ``"512MB"`` -> 512000000; a bare number is bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise UnknownDeviceError(f"cannot read memory size {text!r}; write it like 4GiB or 512MiB")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise UnknownDeviceError(f"memory size must be positive, got {text!r}")
    return value


def format_bytes(n: float) -> str:
    """Bytes in binary units with 3 significant digits: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(n)} B"
            return f"{sign}{n:#.3g} {unit}" if n < 100 else f"{sign}{n:.0f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _compact_size(n: int) -> str:
    """4294967296 -> '4GiB'; 1536 MiB -> '1536MiB' (exact, for device names)."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


@dataclass(frozen=True)
class DeviceInfo:
    """A device to train on, present or planned.

    ``capacity_bytes`` is what a training process may fill on it, runtime context
    included; an estimate fits when ``peak_reserved + overhead_bytes <= capacity``.
    """

    name: str  # as the user wrote it, normalised (catalog name, "cpu:4GiB", "cuda:0")
    kind: str  # "cuda" | "cpu" | other torch.accelerator types
    present: bool  # a device this process can run on
    capacity_bytes: int
    total_bytes: int  # physical memory of the device
    allocator: str  # "cuda" (caching allocator) | "cpu"
    bf16: bool
    fp16: bool
    index: int | None = None
    product: str | None = None  # catalog entry it matches ("H100-80GB"), if any
    capped: bool = False  # capacity set by the user (cpu:4GiB)
    context_bytes: int = 0  # runtime context, outside the allocator
    workspace_bytes: int = 0  # cuBLAS workspace
    bf16_tflops: float | None = None
    fp16_tflops: float | None = None
    fp32_tflops: float | None = None
    bandwidth_gbs: float | None = None
    compute_capability: str | None = None
    host_link_gbs: float | None = None  # pinned host <-> device copies, GB/s one way
    peer_link_gbs: float | None = None  # to the other cards of the node, GB/s one way
    network_gbs: float | None = None  # this card's share of the network between nodes
    nproc_per_node: int = 1  # ranks (devices like this one) per node in the run
    nnodes: int = 1  # nodes in the run

    @property
    def overhead_bytes(self) -> int:
        """Device memory used outside the tensors: context + workspace."""
        return self.context_bytes + self.workspace_bytes

    def peak_tflops(self, precision: str) -> float | None:
        """Peak dense matmul TFLOP/s for a Lightning precision name."""
        if precision.startswith("bf16"):
            return self.bf16_tflops
        if precision.startswith("16"):
            return self.fp16_tflops
        return self.fp32_tflops


@cache
def catalog() -> dict[str, dict[str, Any]]:
    """The GPU catalog: name -> entry (see catalog.toml for the fields)."""
    with open(Path(__file__).with_name("catalog.toml"), "rb") as f:
        return tomllib.load(f)


def _catalog_lookup(name: str) -> str | None:
    key = name.strip().lower().replace(" ", "-").replace("_", "-")
    for entry, d in catalog().items():
        names = [entry] + list(d.get("aliases", []))
        if any(key == n.lower() for n in names):
            return entry
    return None


def _from_catalog(entry: str, *, present: bool = False, index: int | None = None) -> DeviceInfo:
    d = catalog()[entry]
    total = int(d["memory_mib"] * MiB)
    return DeviceInfo(
        name=entry if not present else f"cuda:{index}",
        kind="cuda",
        present=present,
        capacity_bytes=total,
        total_bytes=total,
        allocator="cuda",
        bf16=bool(d["bf16"]),
        fp16=bool(d["fp16"]),
        index=index,
        product=entry,
        context_bytes=int(d["context_mib"] * MiB),
        workspace_bytes=int(d["cublas_workspace_mib"] * MiB),
        bf16_tflops=float(d["bf16_tflops"]) or None,
        fp16_tflops=float(d["fp16_tflops"]) or None,
        fp32_tflops=float(d["fp32_tflops"]) or None,
        bandwidth_gbs=float(d["bandwidth_gbs"]),
        compute_capability=str(d["compute_capability"]),
        host_link_gbs=float(d.get("host_link_gbs", 0)) or None,
        peer_link_gbs=float(d.get("peer_link_gbs", 0)) or None,
        network_gbs=float(d.get("network_gbs", 0)) or None,
    )


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def _cpu(cap: int | None, name: str) -> DeviceInfo:
    mi = _meminfo()
    total = mi.get("MemTotal") or (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    available = mi.get("MemAvailable", total)
    if cap is not None and cap > total:
        raise UnknownDeviceError(
            f"{name}: the cap {format_bytes(cap)} is more than this machine's "
            f"{format_bytes(total)} of memory; use a smaller cap"
        )
    return DeviceInfo(
        name=name,
        kind="cpu",
        present=True,
        capacity_bytes=cap if cap is not None else available,
        total_bytes=total,
        allocator="cpu",
        bf16=True,  # torch.autocast("cpu", bfloat16) and bf16 kernels exist on every CPU
        fp16=True,
        capped=cap is not None,
    )


# What a CPU's half-precision matmuls cost beside fp32 ones, on one thread (as a trial runs).
# bf16 and fp16 kernels exist on every CPU, but only AVX512-BF16 / AMX (bf16) and AVX512-FP16
# run them natively; elsewhere they take torch's generic gemm. Measured on an AVX2-only AMD
# EPYC (torch 2.13, one thread, 512 x 512): fp32 5.0 ms, bf16 216 ms, fp16 208 ms -- a
# bf16-mixed trial ran 43x slower than a 32-true one and the quick start's first trial
# hit the 600 s trial timeout. A ratio between 1/2 and 2 is noise (1.0); outside, the power
# of two nearest to it.
_RATE_SIZE = 256
_RATE_FLOOR_S = 0.02  # time each dtype at least this long (or _RATE_REPEATS matmuls)
_RATE_REPEATS = 8


def _matmul_seconds(torch: Any, dtype: Any) -> float:
    import time

    a = torch.ones(_RATE_SIZE, _RATE_SIZE, dtype=dtype)  # no RNG: the user's stream is theirs
    a @ a  # first call: kernel selection, allocation
    best, spent, n = float("inf"), 0.0, 0
    while n < _RATE_REPEATS and (n < 2 or spent < _RATE_FLOOR_S):
        t = time.perf_counter()
        a @ a
        dt = time.perf_counter() - t
        best, spent, n = min(best, dt), spent + dt, n + 1
    return best


@cache
def _cpu_rates() -> dict[str, float]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32 = _matmul_seconds(torch, torch.float32)
        out = {}
        for name, dtype in (("bf16", torch.bfloat16), ("16", torch.float16)):
            r = fp32 / max(_matmul_seconds(torch, dtype), 1e-9)
            out[name] = 1.0 if 0.5 <= r <= 2.0 else 2.0 ** round(math.log2(r))
        return out
    finally:
        torch.set_num_threads(threads)


@cache
def cpu_capability() -> str:
    """The instruction set torch's CPU kernels use here: ``"AVX2"``, ``"AVX512"``,
    ``"DEFAULT"`` (no vector extension torch dispatches on, e.g. most ARM builds), ...
    The math libraries' buffer caches differ by it (``cpu_library_cache_bytes``)."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


@cache
def cpu_onednn_fp16() -> bool:
    """Whether this CPU's torch runs fp16 matmuls in oneDNN: only with AVX512-FP16 or
    AMX-FP16 (torch's ``mkldnn_fp16_device_check``); bf16 ones run there on any AVX512 CPU.
    Elsewhere fp16 takes torch's own kernels, which keep no oneDNN state."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):  # a torch without the query
        return False


@cache
def cpu_vendor() -> str:
    """This CPU's maker as the kernel reports it: ``"Intel"``, ``"AMD"``, another
    ``vendor_id``, or ``"?"`` (no ``/proc/cpuinfo``). The math libraries' caches differ by
    it too: MKL packs fp32 weights on a Xeon, not on an AMD EPYC
    (``cpu_library_cache_bytes``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    vendor = line.split(":", 1)[1].strip()
                    return {"GenuineIntel": "Intel", "AuthenticAMD": "AMD"}.get(vendor, vendor)
    except OSError:
        pass
    return "?"


def cpu_matmul_speed(precision: str) -> float:
    """This CPU's matmul speed at ``precision`` (a Lightning name) relative to fp32, one thread.

    1.0 for ``32-true`` and wherever half precision runs natively; e.g. 1/32 for
    ``bf16-mixed`` on a CPU without AVX512-BF16 (measured once per process).
    """
    for prefix, rate in _cpu_rates().items():
        if precision.startswith(prefix):
            return rate
    return 1.0


def _cuda(index: int | None) -> DeviceInfo:
    import torch

    if not torch.cuda.is_available():
        raise UnknownDeviceError(
            "no CUDA device is present here; plan for a card by its catalog name (e.g. "
            + fix("--device H100-80GB) or use --device cpu", "device='H100-80GB') or use device='cpu'")
        )
    i = torch.cuda.current_device() if index is None else index
    if i >= torch.cuda.device_count():
        raise UnknownDeviceError(
            f"cuda:{i} does not exist; this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    free, total = torch.cuda.mem_get_info(i)
    props = torch.cuda.get_device_properties(i)
    product = _catalog_lookup(props.name.replace(" ", "-"))
    if product is None:  # match by the words of the name ("NVIDIA H100 80GB HBM3")
        words = props.name.upper().replace("NVIDIA", "").split()
        for entry in catalog():
            if words and entry.split("-")[0] in words:
                product = entry
                break
    base = _from_catalog(product) if product else None
    reserved = torch.cuda.memory_reserved(i)
    # mem_get_info created the context already: free excludes it, so the capacity
    # this process may fill is free + what torch already caches + the context.
    context = base.context_bytes if base else 300 * MiB
    workspace = base.workspace_bytes if base else int(8.5 * MiB)
    hip = getattr(torch.version, "hip", None) is not None
    return DeviceInfo(
        name=f"cuda:{i}",
        kind="cuda",
        present=True,
        capacity_bytes=int(free + reserved + context),
        total_bytes=int(total),
        allocator="cuda",
        bf16=bool(torch.cuda.is_bf16_supported()),
        fp16=True,
        index=i,
        product=product,
        context_bytes=context,
        workspace_bytes=workspace,
        bf16_tflops=base.bf16_tflops if base else None,
        fp16_tflops=base.fp16_tflops if base else None,
        fp32_tflops=base.fp32_tflops if base else None,
        bandwidth_gbs=base.bandwidth_gbs if base else None,
        compute_capability=(props.gcnArchName if hip else f"{props.major}.{props.minor}"),
        host_link_gbs=base.host_link_gbs if base else None,
        peer_link_gbs=base.peer_link_gbs if base else None,
        network_gbs=base.network_gbs if base else None,
    )


def resolve_device(device: str | DeviceInfo | None = "auto") -> DeviceInfo:
    """Turn a device name into a DeviceInfo (see the module docstring).

    Raises:
        UnknownDeviceError: the name is unknown (the message lists close matches).
    """
    if isinstance(device, DeviceInfo):
        return device
    name = "auto" if device is None else str(device).strip()
    low = name.lower()
    if low == "auto":
        import torch

        if torch.cuda.is_available():
            return _cuda(None)
        return _cpu(None, "cpu")
    if low == "cpu":
        return _cpu(None, "cpu")
    if low.startswith("cpu:"):
        cap = parse_bytes(name[4:])
        return _cpu(cap, f"cpu:{_compact_size(cap)}")
    m = re.fullmatch(r"cuda(?::(\d+))?", low)
    if m:
        return _cuda(int(m.group(1)) if m.group(1) else None)
    entry = _catalog_lookup(name)
    if entry is not None:
        return _from_catalog(entry)
    names = list(catalog())
    for d in catalog().values():
        names += d.get("aliases", [])
    near = difflib.get_close_matches(name.upper(), [n.upper() for n in names], n=3, cutoff=0.4)
    near_names = [n for n in names if n.upper() in near]
    hint = (
        f"did you mean {' or '.join(near_names)}?"
        if near_names
        else f"known cards: {', '.join(catalog())}"
    )
    raise UnknownDeviceError(
        f"unknown device {name!r}; {hint} (or use auto, cpu, cpu:8GiB, cuda, cuda:N)"
    )


# ranks one node runs, at most, where no count of devices says: one rank per card, and the
# largest nodes sold hold 8-16 cards (a bound against a typo, not a catalogue); CPU ranks
# are processes of this machine
MAX_RANKS_PER_NODE = 64


def check_ranks_per_node(nproc_per_node: int, device: DeviceInfo, source: str) -> None:
    """Raise ``BadInputError`` (one line) when one node cannot run ``nproc_per_node`` ranks
    on ``device``: the accelerators of this machine when ``device`` is one of them (one rank
    each), else ``MAX_RANKS_PER_NODE``. ``source`` says where the number came from (a flag,
    a file's metadata)."""
    from autofit.errors import BadInputError

    limit, what = MAX_RANKS_PER_NODE, f"the {MAX_RANKS_PER_NODE} ranks a node runs at most"
    if device.kind != "cpu" and device.present:
        import torch

        count = torch.accelerator.device_count() if hasattr(torch, "accelerator") else 1
        limit, what = max(count, 1), f"this machine's {count} {device.kind} device(s), one each"
    if nproc_per_node > limit:
        raise BadInputError(f"{source}: {nproc_per_node} ranks per node on {device.name} is more "
                            f"than {what}; give the ranks your launcher starts "
                            "(--nproc-per-node, --nnodes)")


def sm_version(device: Any) -> int:
    """A CUDA device's compute capability as an integer (8.0 -> 80), which gates kernels
    (flash attention, bf16); unknown: 80; an AMD gfx name: 90 (a modern card)."""
    cc = getattr(device, "compute_capability", None) or "8.0"
    try:
        major, minor = (int(x) for x in str(cc).split(".")[:2])
    except ValueError:
        return 90
    return major * 10 + minor
