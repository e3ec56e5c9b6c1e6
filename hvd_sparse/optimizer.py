"""``hvd_sparse.DistributedOptimizer``: Horovod's optimizer semantics, reductions by hvd_sparse.

Same contract as ``hvd.DistributedOptimizer`` (op, gradient_predivide_factor, process_set,
backward_passes_per_step, sparse_as_dense, synchronize/skip_synchronize), without Horovod's
placeholder allreduces: each gradient's reduction starts from a post-accumulate-grad hook
during backward. Horovod's compression, num_groups and groups are refused by name.
"""
from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import horovod.torch as hvd
import torch
from horovod.torch.optimizer import DistributedOptimizer as _HvdDistributedOptimizer

from . import schemes
from .comm import horovod as horovod_comm
from .engine import Handle
from .errors import HvdSparseError
from .mpi_ops import allreduce_async, allreduce_async_, synchronize
from .reduction import densified
from .sparsifiers import DGC, MomentumMemory, ResidualMemory, Sparsifier

SPARSIFIER_KEY = "hvd_sparse.sparsifier"  # the sparsifier's state in the state_dict
# what a sparsifier sparsifies (docs/notes/adam-accuracy.md)
SPARSIFY = ("gradient", "update", "frozen")
STEPS_KEY = "hvd_sparse.steps"  # steps taken, in the state_dict: when the dense warm-up ends
# local_updates: the parameters every rank agrees on, in the state_dict (in parameter order)
CONSENSUS_KEY = "hvd_sparse.consensus"
# "frozen": each frozen denominator sqrt(v) + eps is at least this times its tensor's mean, so a
# coordinate with a tiny v at the freeze (an embedding row the warm-up hardly saw) does not
# step by g / eps later (docs/notes/adam-accuracy.md: 1e-3 let the byte embedding move 52x as
# far as under dense Adam)
FROZEN_FLOOR = 0.1


class _SparseDistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params: Any, named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
                 scheme: str | None, block_size: int | None, op: Any,
                 gradient_predivide_factor: float, backward_passes_per_step: int,
                 sparsifier: Sparsifier | None, process_set: hvd.ProcessSet,
                 sparse_as_dense: bool, sparsify: str = "gradient",
                 dense_steps: int = 0, local_updates: bool = False,
                 refresh_cap: int = 0) -> None:
        super(self.__class__, self).__init__(params)
        all_params = [p for g in self.param_groups for p in g["params"]]
        self._names = _names(named_parameters, all_params)
        # Horovod's optimizer has it (parameter -> name); code written for Horovod reads it
        self._parameter_names = {p: self._names[id(p)] for p in all_params}
        self._scheme, self._block_size, self._op = scheme, block_size, op
        self._sparsifier = sparsifier
        # "update": each rank steps its optimizer on its own gradients and the ranks average
        # what it applied, sparsified with error feedback (``_step_update``)
        self._sparsify_update = sparsifier is not None and sparsify == "update"
        # "frozen": after ``dense_steps`` dense Adam steps, Adam's second moment stops and the
        # preconditioned gradient is sparsified (``_step_frozen``)
        self._frozen = sparsifier is not None and sparsify == "frozen"
        self._dense_steps, self._refresh_cap = dense_steps, refresh_cap
        self._steps_taken = 0  # steps of this wrapper: the first dense_steps reduce dense
        self._denoms: dict[torch.Tensor, torch.Tensor] = {}  # "frozen": sqrt(v_hat) + eps
        # local_updates: per parameter, the value every rank agrees on; the parameter itself is
        # that plus this rank's updates error feedback has not sent yet (``_step_frozen``)
        self._local = self._frozen and local_updates
        self._consensus: dict[torch.Tensor, torch.Tensor] = {}
        if isinstance(sparsifier, DGC):
            sparsifier.take_momentum(self.param_groups)
        if self._frozen and type(sparsifier.memory) is ResidualMemory:
            # Error feedback on what Adam would apply: its first moment accumulated before
            # selection, as DGC's momentum correction does. Residuals of g / d alone, with the
            # momentum after the average, trailed dense Adam by 18% on the LM against 10%
            # (docs/notes/adam-accuracy.md).
            sparsifier.memory = MomentumMemory()
        if self._frozen and isinstance(sparsifier.memory, MomentumMemory):
            # its momentum correction is Adam's first moment, before selection, and exact: not
            # masked where sent, so a coordinate sent every step keeps Adam's momentum (masked,
            # it stepped by lr (1 - b1) g / d alone; TopK on the LM trailed dense by +2.2%
            # against +1.4%, docs/notes/adam-accuracy.md)
            sparsifier.memory.momentum = self.param_groups[0]["betas"][0]
            sparsifier.memory.masking = False
            if isinstance(sparsifier, DGC):
                sparsifier.momentum = sparsifier.memory.momentum
        self._predivide = gradient_predivide_factor
        self._sparse_as_dense = sparse_as_dense
        self._passes_per_step = backward_passes_per_step
        self.process_set = process_set
        self._passes: dict[torch.Tensor, int] = {}
        self._handles: dict[torch.Tensor, Handle] = {}
        self._sparse: set[torch.Tensor] = set()  # parameters seen with sparse gradients
        self._synchronized = False
        self._should_synchronize = True
        if not process_set.included():  # as Horovod: this rank steps on its own gradients
            return
        for p in all_params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _warming(self) -> bool:
        """Whether this step reduces dense, without the sparsifier: one of the first
        ``dense_steps`` or, with "frozen", a refresh of Adam's second moment."""
        return self._dense_step(self._steps_taken)

    def _dense_step(self, t: int) -> bool:
        """Whether step ``t`` (from 0) is dense: t < W = ``dense_steps``, and with "frozen"
        the refreshes: t = jW for j = 2, 4, 8, ... up to C = ``refresh_cap``, then every
        multiple of C (0/1 Adam's intervals that double, clipped)."""
        w, cap = self._dense_steps, self._refresh_cap
        if t < w:
            return True
        if not self._frozen or t < 2 * w or t % w:
            return False
        j = t // w
        doubling = (j & (j - 1)) == 0 and (not cap or j <= cap)
        return doubling or (cap > 0 and j % cap == 0)

    def _last_dense(self, t: int) -> int:
        """The last dense step at or before step ``t`` (from 0), for t >= W - 1."""
        w, cap = self._dense_steps, self._refresh_cap
        if t < 2 * w:
            return min(t, w - 1)
        j = t // w
        doubled = 1 << (j.bit_length() - 1)
        if cap and doubled > cap:
            doubled = 0
        return w * max(doubled, j // cap * cap if cap else 0)

    def _on_grad(self, p: torch.Tensor) -> None:
        if self._sparsify_update and not self._warming():
            return  # nothing leaves before the step: the update is reduced
        if p in self._handles:
            raise HvdSparseError(
                f"hvd_sparse: gradient of {self._names[id(p)]!r} computed more times than "
                f"backward_passes_per_step={self._passes_per_step} before step()")
        self._passes[p] = self._passes.get(p, 0) + 1
        if self._passes[p] == self._passes_per_step:
            self._submit(p)

    def _submit(self, p: torch.Tensor) -> None:
        if p.grad is None:  # another rank may have a gradient for it: take part with zeros
            p.grad = (torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.long),
                                              p.new_empty((0, *p.shape[1:])), p.shape)
                      if p in self._sparse else torch.zeros_like(p))
        elif p.grad.is_sparse:  # remembered: the peers of a step without it send rows
            self._sparse.add(p)
        pre, post = ((1.0 / self._predivide, self._predivide) if self._op == hvd.Average
                     else (1.0, 1.0))
        if self._frozen and p.grad.is_sparse:
            raise HvdSparseError(f"hvd_sparse: sparsify='frozen' takes dense gradients; "
                                 f"{self._names[id(p)]!r} had a sparse one (use "
                                 "sparsify='gradient')")
        grad = p.grad
        if self._sparse_as_dense and grad.is_sparse:
            grad = densified(grad)  # reduced by blocks, handed back sparse (as Horovod does)
        scheme, sparsifier = self._scheme, self._sparsifier
        if self._sparsifier is not None and self._warming():
            scheme, sparsifier = "dense", None  # the warm-up: every byte, counted as usual
        elif self._frozen:
            # error feedback on what Adam would step by, in units of its frozen scaling
            grad.div_(self._denominator(p))
            pre, post = 1.0, 1.0  # Average: the mean of the preconditioned gradients
        start = allreduce_async_ if grad is p.grad and not grad.is_sparse else allreduce_async
        self._handles[p] = start(grad, name=self._names[id(p)],
                                 op=hvd.Average if self._frozen else self._op,
                                 scheme=scheme, prescale_factor=pre,
                                 postscale_factor=post, block_size=self._block_size,
                                 process_set=self.process_set, sparsifier=sparsifier)

    def synchronize(self) -> None:
        """Waits for every gradient's reduction and writes the results into ``p.grad``.

        A failure (``HvdSparseInternalError``, which ``hvd.elastic.run`` recovers from)
        leaves nothing in flight here: the step's other reductions are forgotten (the engine
        abandons them when hvd_sparse joins the ranks again), so the step can run anew."""
        if not self.process_set.included() or (self._sparsify_update and not self._warming()):
            # sparsify="update": gradients stay this rank's own; step() reduces the update
            self._synchronized = True
            return
        try:
            for g in self.param_groups:
                for p in g["params"]:
                    if p.requires_grad and p not in self._handles:
                        self._submit(p)
            for p, h in self._handles.items():
                out = synchronize(h)
                if p.grad.is_sparse:  # reduced by rows, coalesced (or sparse_as_dense's, made
                    p.grad = out if out.is_sparse else out.to_sparse()  # sparse again)
                # dense gradients were reduced in place
        finally:
            self._forget()
        self._synchronized = True

    def _forget(self) -> None:
        """Nothing of this step in flight any more (after it, or after a failure)."""
        self._handles.clear()
        self._passes.clear()

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "after optimizer.synchronize(): gradients were reduced twice?",
                              stacklevel=2)
            self.synchronize()
        self._synchronized = False
        included = self.process_set.included()
        try:
            if self._sparsify_update and included and not self._warming():
                return self._step_update(closure)
            if self._frozen and included and self._steps_taken >= self._dense_steps:
                return self._step_frozen(closure, refresh=self._warming())
            return super(self.__class__, self).step(closure)
        finally:
            self._steps_taken += 1

    def _denominator(self, p: torch.Tensor, upto: int | None = None) -> torch.Tensor:
        """sparsify="frozen": Adam's denominator sqrt(v_hat) + eps of ``p`` as its state holds
        it since the last dense step (v bias-corrected for that step's count), at least
        ``FROZEN_FLOOR`` times its mean. The same on every rank: v was built from gradients
        averaged over the ranks. Kept until the next dense step; computed from the
        optimizer's state (so a loaded state_dict gives it back). ``upto``: the step whose
        v it is (default: the last one taken)."""
        d = self._denoms.get(p)
        if d is None:
            group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
            v = self.state[p].get("exp_avg_sq")
            if v is None:
                raise HvdSparseError(f"hvd_sparse: sparsify='frozen': {self._names[id(p)]!r} "
                                     "has no second moment after the dense warm-up (no "
                                     "gradient in its first dense_steps steps?)")
            b2 = group["betas"][1]
            upto = self._steps_taken - 1 if upto is None else upto
            last = self._last_dense(upto) + 1  # the steps v has weighed: 1, 2, ...
            d = (v / (1 - b2 ** last)).sqrt_().add_(group["eps"])
            d = self._denoms[p] = d.clamp_(min=FROZEN_FLOOR * float(d.mean()))
        return d

    def _step_frozen(self, closure: Any, refresh: bool) -> Any:
        """sparsify="frozen" after the warm-up: 1-bit Adam's recipe (Tang et al., 2021) with
        this sparsifier in place of its 1-bit compression. Each gradient was divided by Adam's
        frozen denominator d and reduced with error feedback on that (``_submit``): the
        sparsifier's memory holds preconditioned residuals, so a coordinate's delayed spike
        is not squared into a second moment, and TopK selects the coordinates Adam would
        move most. Here, on every rank alike: the gradient g = mean(g / d) * d (left in
        ``p.grad``), weight decay as the optimizer does it, Adam's first moment and step count
        updated in its state, and p -= lr / (1 - b1^t) * m / d. The second moment stays as
        the last dense step left it.

        ``refresh``: a dense step after the warm-up (steps 2W, 4W, ...; the gradients were
        averaged whole). Frozen since the last dense step k steps ago, v takes this gradient
        as the one of those k steps: v = b2^k v + (1 - b2^k) g^2, so v weighs the run's
        stretches as dense Adam's does (a v frozen at 15 of 300 steps held the start's
        gradients only: unsparsified, it trailed dense Adam by 7%, docs/notes/adam-accuracy.md);
        d is then recomputed, and the step goes on as above."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        momentum_corrected = isinstance(getattr(self._sparsifier, "memory", None),
                                        MomentumMemory)
        t = self._steps_taken
        if refresh:
            since = t - self._last_dense(t - 1)
            self._denoms.clear()  # from the refreshed v, below (its last dense step: t)
        with torch.no_grad():
            for group in self.param_groups:
                b1 = group["betas"][0]
                lr, wd = float(group["lr"]), group["weight_decay"]
                decoupled = group.get("decoupled_weight_decay",
                                      isinstance(self, torch.optim.AdamW))
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    if refresh:  # p.grad: the dense average
                        keep = group["betas"][1] ** since
                        st["exp_avg_sq"].mul_(keep).addcmul_(p.grad, p.grad, value=1 - keep)
                        p.grad.div_(self._denominator(p, upto=t))  # as a sparse step's
                    d = self._denominator(p)
                    x = p
                    if self._local:  # the step moves what the ranks agree on
                        x = self._consensus.get(p)
                        if x is None:  # the first step after the warm-up: p is agreed on
                            x = self._consensus[p] = p.detach().clone()
                    if wd and decoupled:
                        x.mul_(1 - lr * wd)
                    st["step"] += 1
                    if momentum_corrected:
                        # the memory did Adam's momentum before selection (sum u = b1 u +
                        # g / d): the mean of what was sent, scaled as Adam's m is, is the step
                        # (a refresh's dense g / d steps the same way, without momentum)
                        x.sub_(p.grad, alpha=lr * (1 - b1))
                        if wd and not decoupled:  # L2 on the parameters, the same on all
                            x.addcdiv_(x, d, value=-lr * wd)
                        p.grad.mul_(d)
                        if self._local:  # and this rank's own momentum not sent yet
                            p.copy_(x).sub_(self._unsent(p), alpha=lr * (1 - b1))
                        continue
                    g = p.grad.mul_(d)
                    if wd and not decoupled:
                        g = g.add(p, alpha=wd)
                    st["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
                    p.addcdiv_(st["exp_avg"], d, value=-lr / (1 - b1 ** float(st["step"])))
        if refresh and self._local:
            self.flush()
        return loss

    def _unsent(self, p: torch.Tensor) -> torch.Tensor:
        """local_updates: this rank's error-feedback residual of ``p`` (what its momentum
        accumulated that was not sent), shaped as ``p``; zeros before the first."""
        r = self._sparsifier.memory.residuals.get(self._names[id(p)])
        return torch.zeros_like(p) if r is None else r.view_as(p)

    def flush(self) -> None:
        """``local_updates=True``: averages every rank's updates not sent yet into the
        parameters, so that all ranks hold the same ones again (one dense reduction of each
        tensor, counted in ``metrics()`` under its name + ".flush"). Call it on every rank
        before evaluating or saving a model that must be the same everywhere, e.g. at the end
        of training; the dense steps that refresh Adam's second moment flush too. Without
        ``local_updates`` nothing is kept back from the parameters and it does nothing.

        Raises:
            HvdSparseInternalError: a reduction failed (as ``step()``).
        """
        if not self._local or not self._consensus or not self.process_set.included():
            return
        handles = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p in self._consensus:
                    r = self._unsent(p)  # zeros where none yet: every rank sends every tensor
                    handles[p] = (r, allreduce_async_(r, name=self._names[id(p)] + ".flush",
                                                      op=hvd.Average, scheme="dense",
                                                      process_set=self.process_set))
        with torch.no_grad():
            for group in self.param_groups:
                scale = float(group["lr"]) * (1 - group["betas"][0])
                for p in group["params"]:
                    if p in handles:
                        r, h = handles.pop(p)
                        synchronize(h)
                        self._consensus[p].sub_(r, alpha=scale)
                        r.zero_()
                        p.copy_(self._consensus[p])

    def _step_update(self, closure: Any) -> Any:
        """sparsify="update": the wrapped optimizer steps on this rank's own gradients; what it
        moved each parameter by is sparsified (error feedback on it: the sparsifier's memory
        holds what this rank's optimizer applied and the ranks did not yet) and averaged over
        the ranks, and every rank applies that average to the parameters as they were, so all
        end with the same parameters. The optimizer's state (Adam's moments) is this rank's
        own, from its own gradients, like the error-feedback memory; its shape and keys are
        the optimizer's.

        Why: Adam divides each coordinate by the root of its squared-gradient average. A
        sparsified gradient reaches a coordinate as a rare spike carrying many steps of
        residual; that spike inflates the coordinate's second moment, so the weights move
        0.4-0.8x as far as under dense Adam (scripts/checks/adam_diagnosis.py). The update is
        already scaled, so error feedback on it keeps its size; what remains (staleness, and
        per-rank second moments from smaller batches) is in docs/notes/adam-accuracy.md."""
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        sparse = [self._names[id(p)] for p in params if p.grad is not None and p.grad.is_sparse]
        if sparse:
            raise HvdSparseError(f"hvd_sparse: sparsify='update' takes dense gradients; "
                                 f"{', '.join(sparse)} had sparse ones (use "
                                 "sparsify='gradient')")
        with torch.no_grad():
            before = [p.detach().clone() for p in params]
        loss = super(self.__class__, self).step(closure)
        with torch.no_grad():
            deltas = [old - p.detach() for old, p in zip(before, params, strict=True)]
            try:
                # every parameter on every rank, moved or not, so the reductions match
                handles = [allreduce_async_(d, name=self._names[id(p)], op=hvd.Average,
                                            scheme=self._scheme, block_size=self._block_size,
                                            process_set=self.process_set,
                                            sparsifier=self._sparsifier)
                           for d, p in zip(deltas, params, strict=True)]
                for h in handles:
                    synchronize(h)
            finally:
                self._forget()
            for p, old, d in zip(params, before, deltas, strict=True):
                p.copy_(old.sub_(d))
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state and, with a sparsifier, its state (this rank's
        error-feedback residuals: every rank saves and loads its own); with ``dense_steps``,
        the steps taken (``STEPS_KEY``: when the warm-up ends). Plain torch's optimizer loads
        it: the extra keys are ignored."""
        d = super(self.__class__, self).state_dict()
        if self._sparsifier is not None:
            d[SPARSIFIER_KEY] = self._sparsifier.state_dict()
        if self._dense_steps:
            d[STEPS_KEY] = self._steps_taken
        if self._consensus:
            d[CONSENSUS_KEY] = [self._consensus.get(p) for g in self.param_groups
                                for p in g["params"]]
        return d

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # a restore (hvd.elastic's, after a failure mid-step): that step's reductions are gone
        # (as Horovod's own optimizer resets its handles here)
        self._forget()
        self._synchronized, self._should_synchronize = False, True
        state_dict = dict(state_dict)
        sparsifier = state_dict.pop(SPARSIFIER_KEY, None)
        self._steps_taken = int(state_dict.pop(STEPS_KEY, self._steps_taken))
        consensus = state_dict.pop(CONSENSUS_KEY, None)
        super(self.__class__, self).load_state_dict(state_dict)
        self._consensus.clear()
        if consensus is not None and self._local:
            params = [p for g in self.param_groups for p in g["params"]]
            self._consensus.update((p, x.to(p.device, p.dtype).clone())
                                   for p, x in zip(params, consensus, strict=True)
                                   if x is not None)
        self._denoms.clear()  # from the loaded second moments at the next use
        if sparsifier is not None and self._sparsifier is not None:
            self._sparsifier.load_state_dict(sparsifier)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise AssertionError("optimizer.zero_grad() called after backward() but before "
                                 "step() or synchronize()")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)


def _names(named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
           params: list[torch.Tensor]) -> dict[int, str]:
    """id(parameter) -> name; the name keys its reduction on every rank, so it must be unique."""
    if named_parameters is None:
        return {id(p): f"param.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) for item in named):
        raise ValueError("named_parameters must be a sequence of (name, parameter) tuples, "
                         "as model.named_parameters() yields")
    dups = sorted(n for n, count in Counter(n for n, _ in named).items() if count > 1)
    if dups:
        raise ValueError(f"parameter names in named_parameters must be unique; duplicates: "
                         f"{', '.join(dups)}")
    names = {id(p): n for n, p in named}
    if len(names) != len(named):
        raise ValueError("named_parameters has duplicate parameters")
    unnamed = [p for p in params if id(p) not in names]
    if unnamed:
        raise ValueError(f"{len(unnamed)} optimizer parameter(s) missing from named_parameters")
    return names


def DistributedOptimizer(  # noqa: N802 - name fixed by Horovod's API
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    scheme: str | None = None,
    block_size: int | None = None,
    op: Any = None,
    gradient_predivide_factor: float = 1.0,
    backward_passes_per_step: int = 1,
    sparsifier: Sparsifier | None = None,
    process_set: hvd.ProcessSet = hvd.global_process_set,
    *,
    sparse_as_dense: bool = False,
    sparsify: str = "gradient",
    dense_steps: int = 0,
    local_updates: bool = False,
    refresh_cap: int = 8,
    compression: Any = None,
    num_groups: int = 0,
    groups: Any = None,
) -> torch.optim.Optimizer:
    """Wraps ``optimizer`` so ``step()`` applies gradients reduced across ranks by hvd_sparse.

    Horovod's ``hvd.DistributedOptimizer`` contract (op, gradient_predivide_factor,
    backward_passes_per_step, process_set, sparse_as_dense, synchronize/skip_synchronize),
    without Horovod's placeholder allreduces: each gradient's reduction starts from its
    post-accumulate-grad hook during backward. Sparse gradients (``nn.Embedding(sparse=True)``)
    are reduced by rows and stay sparse. Tensors too small to sparsify
    (``Sparsifier.too_small``: by size and density) go out whole by the dense scheme.

    Args:
        optimizer: the optimizer to wrap.
        named_parameters: ``model.named_parameters()``: names match gradients across ranks
            (default: the optimizer's parameter order).
        scheme: "auto", "dense", "allgather", "zen", "omnireduce" or "switch"; None: the
            configured one.
        block_size: the codec's block in elements; element-wise sparsifiers (TopK,
            Threshold, DGC) want a small one (1..32).
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        gradient_predivide_factor: with ``hvd.Average``, divide by this before the sum and
            by size / factor after it, as Horovod does.
        backward_passes_per_step: backward passes accumulated locally before a reduction.
        sparsifier: sparsifies each dense gradient before its reduction, with error feedback
            (e.g. ``hvd_sparse.ExDyna(density=0.01)``).
        process_set: gradients are reduced over its ranks only; other ranks step on their
            own gradients, as with Horovod's optimizer.
        sparse_as_dense: densify sparse gradients and reduce them by blocks (Horovod's option).
        sparsify: what ``sparsifier`` sparsifies: "gradient" (default: each gradient,
            reduced during backward, then the optimizer steps on the average) or "update"
            (each rank's optimizer steps on its own gradients; what it applied is sparsified
            with error feedback and averaged, and every rank applies the average: the
            optimizer's state is then each rank's own). Meant for Adam and AdamW, whose
            per-coordinate scaling shrinks the delayed spikes of gradient error feedback;
            measured so far it closes little of that gap (docs/notes/adam-accuracy.md).
            "update" reduces every parameter in ``step()``, with ``op`` Average whatever
            ``op`` is, and takes dense gradients only. "frozen" (``torch.optim.Adam`` or
            ``AdamW`` only; needs ``dense_steps`` = W): 1-bit Adam's recipe with this
            sparsifier. The first W steps are Adam on dense-averaged gradients; then Adam's
            second moment v stays as it is (the same on every rank), each rank divides its
            gradient by sqrt(v) + eps (at least 0.1x its tensor's mean, ``FROZEN_FLOOR``)
            and sparsifies that with error feedback, and every rank applies Adam's momentum
            and step to the average, so all end with the same parameters. Steps 2W, 4W,
            8W, ... go dense again and refresh v (0/1 Adam's idea; ``refresh_cap``). With
            ``DGC``, its momentum correction (at Adam's beta1) replaces Adam's first moment, and a
            sparsifier with plain error feedback gets one too (a ``MomentumMemory``); either
            runs without factor masking, so every gradient keeps its whole momentum. Dense
            gradients only; the reduction averages whatever ``op`` is. Measured on a
            transformer LM: docs/CONVERGENCE.md.
        dense_steps: the first this many steps reduce every gradient dense, without the
            sparsifier (a warm-up; its bytes show in ``metrics()`` as any reduction's; with
            "frozen" the refreshes too); the steps taken are saved in the state_dict.
            Default 0; "frozen" needs at least 1.
        local_updates: "frozen" only. Each rank's parameters also hold its own updates that
            error feedback has not sent yet (the value the ranks agree on, minus lr (1 -
            beta1) times its residual), so its next gradient is taken where its own steps led
            instead of where they were held back; the ranks' parameters then differ by those
            residuals. ``flush()`` (every rank; one dense reduction) averages them in and
            makes all ranks' parameters the same: call it before a final evaluation or
            checkpoint. The refresh steps flush too. The agreed values ride in the
            state_dict (``CONSENSUS_KEY``). Not under Horovod elastic. Measured on the
            transformer LM: docs/CONVERGENCE.md.
        refresh_cap: "frozen" only: the refreshes of v (and, with ``local_updates``, their
            flushes) come at steps 2W, 4W, 8W, ... while the interval is at most this many
            times W = ``dense_steps``, then every ``refresh_cap`` W steps (default 8: every
            40 steps at W = 5, two dense reductions each: 5% of dense's bytes with
            ``local_updates``); 0: the interval doubles for ever (0/1 Adam). Without the cap
            the ranks' own updates go unaveraged for half the run, and TopK at 0.1% on the
            LM trailed dense by 6% at 300 steps, against 4% with it; over 1,200 steps 0 did
            as well, and its dense steps are a share that shrinks with the run.
        compression: not supported (hvd_sparse compresses itself: ``scheme``, ``sparsifier``);
            only ``None`` or ``hvd.Compression.none``.
        num_groups: not supported (each gradient goes as soon as it is ready); only 0.
        groups: not supported, as ``num_groups``; only None.

    Returns:
        An optimizer of the wrapped one's class with the contract above.

    Under Horovod elastic (``hvd.elastic.TorchState(model=model, optimizer=opt, ...)`` and a
    training function under ``@hvd.elastic.run``), a reduction that fails in ``backward()`` or
    ``step()`` raises ``hvd_sparse.HvdSparseInternalError``, a ``HorovodInternalError``:
    Horovod restores the last commit (the sparsifier's memory, this rank's own, with it: the
    state_dict carries it) and resets, and the next reduction joins the new ranks.

    Raises:
        ValueError: an unsupported ``op``, ``scheme``, ``sparsifier``, ``sparsify``, factor or
            pass count, or one of the unsupported Horovod arguments above, named;
            ``local_updates`` without "frozen" and error feedback, or under Horovod elastic.

    Example:
        >>> opt = hvd_sparse.DistributedOptimizer(
        ...     torch.optim.SGD(model.parameters(), lr=0.1),
        ...     named_parameters=model.named_parameters(), scheme="auto")
    """
    if compression is not None and compression is not hvd.Compression.none:
        raise ValueError(
            "hvd_sparse.DistributedOptimizer does not take compression=: it reduces gradients "
            "itself (choose scheme= and sparsifier=); to keep a Horovod compressor, use "
            "hvd.DistributedOptimizer(compression=hvd_sparse.Compression.sparse(...)) instead")
    if num_groups != 0 or groups is not None:
        raise ValueError(
            "hvd_sparse.DistributedOptimizer does not take num_groups= or groups=: each "
            "gradient's reduction starts as soon as it is ready, nothing waits for a group")
    op = hvd.Average if op is None else op
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError("hvd_sparse.DistributedOptimizer supports op=hvd.Average or hvd.Sum")
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor requires op=hvd.Average")
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1")
    schemes.check(scheme)
    if sparsifier is not None and not isinstance(sparsifier, Sparsifier):
        raise ValueError(f"sparsifier must be an hvd_sparse Sparsifier, got {sparsifier!r}")
    if sparsify not in SPARSIFY:
        raise ValueError(f"sparsify must be one of {SPARSIFY}, got {sparsify!r}")
    if not isinstance(dense_steps, int) or dense_steps < 0:
        raise ValueError(f"dense_steps must be an int >= 0, got {dense_steps!r}")
    if not isinstance(refresh_cap, int) or refresh_cap < 0:
        raise ValueError(f"refresh_cap must be an int >= 0, got {refresh_cap!r}")
    if sparsify == "frozen" and sparsifier is not None:  # without one: plain steps
        _check_frozen(optimizer, dense_steps)
    if local_updates and (sparsify != "frozen" or sparsifier is None
                          or type(sparsifier.memory) not in (ResidualMemory, MomentumMemory)):
        raise ValueError("local_updates=True keeps this rank's unsent updates in its "
                         "parameters: it needs sparsify='frozen' and a sparsifier with error "
                         "feedback")
    if local_updates and horovod_comm.elastic():
        # a worker that joins after a reset has neither the agreed values nor a residual
        raise ValueError("local_updates=True is not supported under Horovod elastic "
                         "(HOROVOD_ELASTIC=1): a rank that joins has no agreed parameters to "
                         "go on from; use sparsify='frozen' without it")
    if dense_steps and isinstance(sparsifier, DGC) and sparsify == "gradient" and any(
            g.get("momentum") for g in optimizer.param_groups):
        raise ValueError("dense_steps with DGC and an optimizer with momentum: DGC takes the "
                         "optimizer's momentum, so the dense steps would have none (use "
                         "DGC(warmup=...) for a warm-up)")
    namespace = dict(_SparseDistributedOptimizer.__dict__)
    # hvd.broadcast_optimizer_state creates missing state with step() on the ranks that lack it
    # only, and skips the gradient reduction for classes from Horovod's optimizer module. Ours
    # must be recognised too: its reduction on only some ranks would wait for the others.
    namespace["__module__"] = _HvdDistributedOptimizer.__module__
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), namespace)
    return cls(optimizer.param_groups, named_parameters, scheme, block_size, op,
               gradient_predivide_factor, backward_passes_per_step, sparsifier, process_set,
               sparse_as_dense, sparsify, dense_steps, local_updates, refresh_cap)


def _check_frozen(optimizer: torch.optim.Optimizer, dense_steps: int) -> None:
    """What sparsify="frozen" needs: Adam or AdamW as ``_step_frozen`` steps it, a warm-up.

    Raises:
        ValueError: another optimizer, an option it does not follow, or no warm-up.
    """
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise ValueError(f"sparsify='frozen' freezes Adam's second moment: it takes "
                         f"torch.optim.Adam or AdamW, got {type(optimizer).__name__}")
    if dense_steps < 1:
        raise ValueError("sparsify='frozen' needs dense_steps >= 1: the second moment it "
                         "freezes comes from those dense Adam steps")
    for g in optimizer.param_groups:
        bad = [k for k in ("amsgrad", "maximize", "capturable", "differentiable")
               if g.get(k)]
        if bad:
            raise ValueError(f"sparsify='frozen' steps Adam itself and does not follow "
                             f"{', '.join(bad)}=True")
