"""Process group, device, parallel wrappers and the few collectives the trainer uses.

Under torchrun (RANK/WORLD_SIZE/LOCAL_RANK set) a process group is created (nccl on CUDA, gloo on
CPU) even for one process, and the objective is wrapped in DDP or FSDP2 as configured. Started
without torchrun (plain ``python -m eagle3.train``) the world is one process, no group exists and the
module runs unwrapped: the math is the same, and nothing needs a free port.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

Parallel = Literal["ddp", "fsdp"]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: rank, world size, local rank and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    initialized: bool  # a process group exists (torchrun), so collectives are real

    @property
    def is_main(self) -> bool:
        """Rank 0 writes files and logs."""
        return self.rank == 0


def init_distributed(device: str = "auto") -> DistInfo:
    """Join torchrun's process group when launched by it; pick cuda:LOCAL_RANK or cpu."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if not launched:
        return DistInfo(0, 1, 0, dev, False)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=dev if use_cuda else None)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dev, True)


def shutdown(info: DistInfo) -> None:
    """Destroy the process group (a clean exit; NCCL warns otherwise)."""
    if info.initialized and dist.is_initialized():
        dist.destroy_process_group()


def wrap(module: nn.Module, parallel: Parallel, info: DistInfo) -> nn.Module:
    """DDP, or FSDP2 over the whole objective (one all-gather per forward: the TTT unroll calls the
    drafter ttt_steps times, so sharding its submodules separately would gather each of them per step)."""
    if not info.initialized:
        return module
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(module)
        return module
    from torch.nn.parallel import DistributedDataParallel

    # broadcast_buffers=False: the buffers (t2d, d2t, the 1 GB target lm_head of an 8B target) are identical
    # on every rank by construction; DDP's default would re-broadcast them at every forward.
    return DistributedDataParallel(
        module, device_ids=[info.device.index] if info.device.type == "cuda" else None, broadcast_buffers=False
    )


def unwrap(module: nn.Module) -> nn.Module:
    """The objective inside a DDP wrapper (FSDP2 shards in place, so it is the module itself)."""
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module


@contextlib.contextmanager
def gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce on every micro-batch but the last of an accumulation window."""
    wrapper: Any = module  # duck-typed: DDP and FSDP2 name the switch differently
    if enabled:
        yield
    elif hasattr(wrapper, "no_sync"):  # DDP
        with wrapper.no_sync():
            yield
    elif hasattr(wrapper, "set_requires_gradient_sync"):  # FSDP2
        wrapper.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            wrapper.set_requires_gradient_sync(True)
    else:
        yield


def all_reduce_sum(x: Tensor, info: DistInfo) -> Tensor:
    """Sum over ranks (in place, returned); identity in a one-process world."""
    if info.initialized:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def all_gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order."""
    if not info.initialized:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not info.initialized:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(info: DistInfo) -> None:
    """Wait for every rank (no-op in a one-process world)."""
    if info.initialized:
        dist.barrier()


def autocast(info: DistInfo) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA over fp32 weights; on CPU nothing (fp32 throughout, deterministic)."""
    if info.device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def full_tensor(x: Tensor) -> Tensor:
    """A DTensor (FSDP2 gradient norms) as a plain tensor; other tensors unchanged."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x
