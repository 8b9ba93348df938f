"""Chorus as a torch.distributed backend.

    import chorus_torch  # registers the backend
    torch.distributed.init_process_group("chorus")

Every process-group operation runs on Chorus over CPU tensors' own memory, with
the GIL released while Chorus works or waits: in the background on torch 2.7 and
later (the backend registered under torch's ProcessGroup), to completion before
the call returns on earlier torch. CUDA tensors work too: all-reduce,
broadcast, reduce, all-gather and reduce-scatter run on the GPU's memory (CUDA IPC
between the ranks of one host, else through pinned host buffers); the other calls
copy them through host memory.

A failed call raises `ChorusError`, a RuntimeError whose `cause`, `culprit` and
`found_by` say what stopped it and which rank is to blame; `failure(group)` gives
it back wherever it surfaced. On torch 2.15 and later the survivors of a death go on
with `torch.distributed.shrink_group([culprit])`.
"""

import torch.distributed as _dist

from ._backend import _CUDA, ProcessGroupChorus, create_process_group, failure
from ._chorus import ChorusError

__all__ = ["ChorusError", "ProcessGroupChorus", "create_process_group", "failure", "BACKEND"]

#: The name to pass to ``torch.distributed.init_process_group``.
BACKEND = "chorus"


def _register():
    if hasattr(_dist.Backend, BACKEND.upper()):
        return
    try:
        # torch 2.x: say which devices the backend serves (it warns otherwise).
        _dist.Backend.register_backend(BACKEND, create_process_group, devices=["cpu", "cuda"] if _CUDA else ["cpu"])
    except TypeError:
        # torch 1.13: no `devices` argument.
        _dist.Backend.register_backend(BACKEND, create_process_group)


_register()
