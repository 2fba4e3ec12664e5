"""roundpipe.device: the devices RoundPipe computes on, by the original's
names (its benchmark scripts read `device_list`, each entry's `.id` and
`.device`). Our engine makes its own device objects per RoundPipe (C++);
these entries describe the visible CUDA devices for scripts."""
from dataclasses import dataclass
from typing import List

import torch

__all__ = ["DeviceInfo", "device_list", "get_num_devices", "get_min_gpu_memory"]


@dataclass(frozen=True)
class DeviceInfo:
    """A visible CUDA device: its index and its torch.device."""
    id: int
    device: torch.device


def _visible() -> List[DeviceInfo]:
    if not torch.cuda.is_available():
        return []
    return [DeviceInfo(i, torch.device("cuda", i)) for i in range(torch.cuda.device_count())]


device_list: List[DeviceInfo] = _visible()


def get_num_devices() -> int:
    """How many CUDA devices are visible."""
    return len(device_list)


def get_min_gpu_memory() -> float:
    """The smallest free memory of the visible devices (bytes; 0 without one)."""
    return float(min((torch.cuda.mem_get_info(d.id)[0] for d in device_list), default=0))
