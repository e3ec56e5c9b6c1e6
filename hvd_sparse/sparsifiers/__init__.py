"""Gradient sparsifiers with error feedback: ``TopK``, ``Threshold``, ``DGC``, ``ExDyna``.

    opt = hvd_sparse.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                          sparsifier=ExDyna(density=0.01))
"""
from .base import Sparsifier
from .dgc import DGC
from .exdyna import ExDyna
from .memory import MomentumMemory, NoMemory, ResidualMemory
from .threshold import Threshold
from .topk import TopK

__all__ = ["DGC", "ExDyna", "MomentumMemory", "NoMemory", "ResidualMemory", "Sparsifier",
           "Threshold", "TopK"]
