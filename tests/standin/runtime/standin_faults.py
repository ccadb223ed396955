"""A worker that returns wrong data (STANDIN_FAULT=wrong-data, loaded by sitecustomize): the process of RANK 1
adds 1 to every tensor it hands torch.distributed.all_reduce, as a faulty link or device would."""

import importlib.util
import os
import sys


def _wrong(all_reduce):
    def all_reduce_wrong(tensor, *args, **kwargs):
        tensor.add_(1)
        return all_reduce(tensor, *args, **kwargs)

    return all_reduce_wrong


class _PatchDistributed:
    def find_spec(self, name, path=None, target=None):
        if name != "torch.distributed":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            module.all_reduce = _wrong(module.all_reduce)

        spec.loader.exec_module = exec_module
        return spec


def install_wrong_data():
    if os.environ.get("RANK") == "1":
        sys.meta_path.insert(0, _PatchDistributed())
