"""The one exception hvd_sparse raises for failed or inconsistent synchronization."""


class HvdSparseError(RuntimeError):
    """A collective failed: ranks disagree on a tensor, a peer timed out, or Horovod failed.

    Raised on every rank that takes part, naming the tensor. Also raised, on the rank where it
    happens, for a use that would leave the other ranks waiting: hvd_sparse not initialized, a
    tensor submitted again while in flight, a rank outside the process set.

    Example:
        >>> try:
        ...     out = hvd_sparse.allreduce(grad, name="emb.weight")
        ... except hvd_sparse.HvdSparseError as e:
        ...     print(e)  # names the tensor and what failed
    """
