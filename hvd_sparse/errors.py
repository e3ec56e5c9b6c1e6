"""The one exception hvd_sparse raises for failed or inconsistent synchronization."""


class HvdSparseError(RuntimeError):
    """A collective failed: ranks disagree on a tensor, a peer timed out, or Horovod failed.

    Raised on every rank that takes part, naming the tensor.
    """
