"""The collectives a scheme runs between ranks, behind one interface (``Collectives``), so no
scheme knows which front end called it: ``horovod`` (Horovod's ops, a process set) and
``distributed`` (``torch.distributed``, a process group, for the DDP front end)."""
from .base import Collectives, Done, Pending

__all__ = ["Collectives", "Done", "Pending"]
