"""A worker leaves its process group with the group's threads ended: what still holds the group only through a
reference cycle (as DDP's reducer and FSDP2's mesh do with the trainer) is collected before the group is
destroyed, so gloo's worker threads join in `close()`, not during interpreter shutdown."""

import gc
import os

import torch.distributed as dist

from neurontrain.loop.dataparallel import DataParallel


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


class _Holder:
    """A trainer-like object in a reference cycle, holding the group."""

    def __init__(self, group) -> None:
        self.group, self.me = group, self


def test_close_ends_the_threads_of_a_group_held_in_a_reference_cycle():
    gc.collect()  # an earlier test's garbage (a TCPStore's thread) would go in close()'s collection and skew the count
    before = _threads()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    _Holder(dist.group.WORLD)  # garbage, but only the cycle collector frees it
    assert _threads() > before  # gloo's worker threads
    dp = DataParallel()
    dp._started = True
    dp.close()
    assert not dist.is_initialized()
    assert _threads() == before
