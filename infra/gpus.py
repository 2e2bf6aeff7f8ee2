"""GPU discovery through ``nvidia-smi`` and token budgets from free memory.

Nothing here imports torch: initializing CUDA in the parent would itself hold memory on every GPU
and make forked children inherit a CUDA context. ``nvidia-smi`` indices are physical ones (they
ignore CUDA_VISIBLE_DEVICES). Compute processes are matched to GPUs by UUID, so both queries ask
for it besides the fields a person reads (index, name, memory; pid, process name, memory).
"""

from __future__ import annotations

import csv
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

QUERY_GPUS = ("--query-gpu=index,uuid,name,memory.total,memory.used", "--format=csv,noheader,nounits")
QUERY_APPS = ("--query-compute-apps=gpu_uuid,pid,process_name,used_memory", "--format=csv,noheader,nounits")
# An idle GPU shows a few MiB used by the driver; more than this without a visible process is
# memory held from another container or namespace.
IDLE_USED_MIB = 1024
MIB = 1 << 20


class GpuQueryError(RuntimeError):
    """nvidia-smi exists but failed (driver not loaded, timeout, unreadable output)."""


class GpuBusyError(RuntimeError):
    """A GPU we were asked to use holds other processes' memory."""


@dataclass(frozen=True)
class GpuProcess:
    """A compute process holding memory on a GPU."""

    pid: int
    name: str
    used_mib: int | None
    gpu_uuid: str


@dataclass(frozen=True)
class Gpu:
    """One GPU as nvidia-smi reports it (memory in MiB)."""

    index: int
    uuid: str
    name: str
    total_mib: int
    used_mib: int
    processes: tuple[GpuProcess, ...] = ()

    @property
    def free_bytes(self) -> int:
        return max(self.total_mib - self.used_mib, 0) * MIB


def _run_smi(args: Sequence[str], nvidia_smi: str, timeout_s: float) -> str | None:
    """stdout of nvidia-smi, or None when it is not installed (a machine without NVIDIA GPUs)."""
    exe = shutil.which(nvidia_smi)
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise GpuQueryError(f"{exe} {' '.join(args)} did not answer within {timeout_s:.0f} s") from None
    if done.returncode != 0:
        raise GpuQueryError(
            f"{exe} {' '.join(args)} failed with code {done.returncode}: {(done.stderr or done.stdout).strip()[:500]}"
        )
    return done.stdout


def _rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in row] for row in csv.reader(text.splitlines(), skipinitialspace=True) if row]


def _mib(cell: str) -> int | None:
    """A memory cell in MiB; None for '[N/A]' / '[Not Supported]' (MIG, some drivers)."""
    try:
        return int(float(cell))
    except ValueError:
        return None


def list_gpus(nvidia_smi: str = "nvidia-smi", timeout_s: float = 30.0) -> list[Gpu]:
    """Every GPU with the compute processes on it; [] when nvidia-smi is not installed."""
    gpu_text = _run_smi(QUERY_GPUS, nvidia_smi, timeout_s)
    if gpu_text is None:
        return []
    apps = _parse_apps(_run_smi(QUERY_APPS, nvidia_smi, timeout_s) or "")
    gpus = []
    for row in _rows(gpu_text):
        if len(row) != 5:
            raise GpuQueryError(f"unexpected nvidia-smi GPU line {row!r} (want index, uuid, name, total, used)")
        index, uuid, name, total, used = row
        gpus.append(
            Gpu(int(index), uuid, name, _mib(total) or 0, _mib(used) or 0, tuple(p for p in apps if p.gpu_uuid == uuid))
        )
    return gpus


def _parse_apps(text: str) -> list[GpuProcess]:
    apps = []
    for row in _rows(text):
        if len(row) != 4 or not row[1].isdigit():
            continue  # "No running processes found" and similar notes
        uuid, pid, name, used = row
        apps.append(GpuProcess(int(pid), name, _mib(used), uuid))
    return apps


def _busy_reason(gpu: Gpu, idle_used_mib: int) -> str | None:
    if gpu.processes:
        held = ", ".join(
            f"pid {p.pid} {p.name} ({p.used_mib if p.used_mib is not None else '?'} MiB)" for p in gpu.processes
        )
        return f"GPU {gpu.index} ({gpu.name}) is in use: {held}; {gpu.used_mib} of {gpu.total_mib} MiB used"
    if gpu.used_mib > idle_used_mib:
        return (
            f"GPU {gpu.index} ({gpu.name}) has {gpu.used_mib} of {gpu.total_mib} MiB used by processes "
            "not visible here (another container?)"
        )
    return None


def check_gpus_free(
    indices: Sequence[int],
    allow_shared: bool = False,
    *,
    gpus: list[Gpu] | None = None,
    idle_used_mib: int = IDLE_USED_MIB,
    nvidia_smi: str = "nvidia-smi",
) -> list[Gpu]:
    """The requested GPUs; GpuBusyError naming pid, process and MiB held unless all are idle or allow_shared."""
    gpus = list_gpus(nvidia_smi) if gpus is None else gpus
    by_index = {gpu.index: gpu for gpu in gpus}
    missing = [i for i in indices if i not in by_index]
    if missing:
        have = ", ".join(str(i) for i in sorted(by_index)) or "none"
        raise GpuBusyError(f"GPU(s) {missing} not found (nvidia-smi lists: {have})")
    chosen = [by_index[i] for i in indices]
    reasons = [r for gpu in chosen if (r := _busy_reason(gpu, idle_used_mib))]
    if reasons and not allow_shared:
        raise GpuBusyError(
            "\n".join(reasons) + "\nstop those processes, pick other GPUs, or allow sharing "
            "(capture.allow_shared_gpus=true) if they leave enough memory"
        )
    return chosen


def activation_bytes_per_token(
    hidden_size: int,
    num_layers: int,
    *,
    intermediate_size: int | None = None,
    kv_size: int | None = None,
    num_aux: int = 3,
    vocab_size: int = 0,
    dtype_bytes: int = 2,
) -> int:
    """GPU bytes one prompt token costs in a capture forward (an upper-bound estimate).

    bytes/token = dtype_bytes * (2 * num_layers * kv_size            KV cache, kept for the whole request
                                 + (num_aux + 1) * H                 captured aux + final rows until copied out
                                 + 3 * H + H + 2 * kv_size           one layer's residual, norm, attention out, q/k/v
                                 + 3 * I)                            one layer's MLP gate, up and activation
                  + 4 * vocab_size                                   fp32 logits, when every position's are kept
    Only one layer's transients count: layers run one after another and free them. kv_size is
    num_kv_heads * head_dim (default H, i.e. no GQA, the largest case); I defaults to 4 * H.
    """
    kv = hidden_size if kv_size is None else kv_size
    inter = 4 * hidden_size if intermediate_size is None else intermediate_size
    per_token = 2 * num_layers * kv + (num_aux + 1) * hidden_size + 4 * hidden_size + 2 * kv + 3 * inter
    return dtype_bytes * per_token + 4 * vocab_size


def token_budget(free_bytes: int, bytes_per_token: int, *, reserved_bytes: int = 0, headroom: float = 0.2) -> int:
    """Prompt tokens per forward that fit: (free - reserved) * (1 - headroom) / bytes_per_token, floored.

    free_bytes: free GPU memory now (``Gpu.free_bytes``); reserved_bytes: what will still be allocated
    before the forward (the weights, if not loaded yet); headroom: the allocator's fragmentation and
    the framework's workspaces, which this estimate does not model.
    """
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be > 0, got {bytes_per_token}")
    usable = (free_bytes - reserved_bytes) * (1.0 - headroom)
    return max(int(usable // bytes_per_token), 0)
