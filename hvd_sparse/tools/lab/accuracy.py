"""The convergence suite's rank side: three tasks, each trained by every method from the same
initial model on the same data split, scored on held-out data after every epoch.

Tasks (``TASKS``):
- ``mlp``: an MLP 64-256-256-10 (ReLU) on a teacher-labelled synthetic task, SGD with momentum
  0.9 in the optimizer, as users write it;
- ``digits``: a small CNN on scikit-learn's bundled handwritten digits (1,797 8x8 images, no
  download), 360 held out;
- ``ctr``: the demo's click-through model (hvd_sparse.tools.workload: embedding tables over
  Zipf ids, whose gradients are mostly-zero rows, plus dense layers), scored by held-out AUC;
- ``lm``: a byte-level transformer language model (2 layers, width 128, context 64, 0.34 M
  parameters) on the Python standard library's own top-level ``.py`` files, ``torch.optim.Adam``
  (lr 3e-3) as users train such models, scored by held-out loss in nats per byte (lower is
  better; docs/notes/adam-accuracy.md). ``HVD_SPARSE_ACC_LM_STEPS`` sets its steps (default 300),
  ``HVD_SPARSE_ACC_LM_LR`` Adam's lr.

Methods (``METHODS``): ``dense`` (hvd_sparse's dense scheme: Horovod's allreduce),
``topk``/``dgc`` at 1% per rank and ``exdyna`` at a 1% union (the paper's setting: 0.25% per
rank at 4 ranks) through ``hvd_sparse.DistributedOptimizer`` (error feedback; DGC with its
density warm-up over the first two epochs and the optimizer's momentum moved into its
correction), ``exdyna4`` (ExDyna at 1% per rank, as TopK and DGC: a 4% union at 4 ranks), and
PowerSGD ranks 1, 2, 4 (``powersgd1`` ...)
under PyTorch DDP with its built-in hook, on a Gloo group made beside Horovod in the same
processes, so every method sees the same ranks, data and initial model. On request
(``EXTRA``): ``topkw``, TopK with DGC's density warm-up; ``dgc0``, DGC without it. Any of
hvd_sparse's methods with ``+bf16`` (``dense+bf16``, ``topk+bf16``) sends its values as
bfloat16 (option ``wire="bf16"``), summed in float32.

Bytes per step are what one rank puts on the wire: hvd_sparse's own count (ring collectives
modelled) for its methods, the ring allreduce model for PowerSGD (its P and Q, and the tensors
it leaves uncompressed) and for DDP's dense allreduce.
"""
from __future__ import annotations

import io
import math
import os
import socket
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import horovod.torch as hvd
import torch
import torch.distributed as dist
from torch import nn

import hvd_sparse
from hvd_sparse.tools.workload import CTRModel, make_shard, vocab_sizes

DENSITY = 0.01
SPARSIFIED = ("topk", "dgc", "exdyna", "exdyna4", "topkw", "dgc0")
POWERSGD = {"powersgd1": 1, "powersgd2": 2, "powersgd4": 4}
METHODS = ("dense", *SPARSIFIED[:-2], *POWERSGD)  # the suite's default
# on request only: "topkw" is TopK with DGC's density warm-up (25% down to the density over
# the first two epochs; its bytes counted), a check of what warm-up buys with Adam; "dgc0" is
# DGC without it (momentum correction alone)
EXTRA = ("topkw", "dgc0")
BF16 = "+bf16"  # suffix: the method with wire="bf16"


def known(method: str) -> bool:
    """Whether ``method`` is one of the suite's (PowerSGD has no 16-bit wire here)."""
    base = method.removesuffix(BF16)
    return base in METHODS + EXTRA and not (method.endswith(BF16) and base in POWERSGD)
Batches = Callable[[int], Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]]


@dataclass
class Task:
    """One training problem, this rank's share of it."""

    epochs: int
    lr: float
    model: Callable[[], nn.Module]  # the same initial weights on every rank (seeded)
    batches: Batches  # epoch -> this rank's (inputs, target) batches, the same count on all
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    score: Callable[[nn.Module], float]  # held-out accuracy or AUC in [0, 1]; lm: a loss
    metric: str
    # the user's optimizer; None: SGD with momentum 0.9 at ``lr``
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None

    def make_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """The task's optimizer over ``params``.

        Args:
            params: the model's parameters.

        Returns:
            ``optimizer(params)``, or SGD with momentum 0.9 at ``lr``.
        """
        if self.optimizer is not None:
            return self.optimizer(params)
        return torch.optim.SGD(params, lr=self.lr, momentum=0.9)


def shuffled(n: int, batch: int, seed: int, epoch: int) -> Iterator[slice | torch.Tensor]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    for i in range(n // batch):
        yield order[i * batch:(i + 1) * batch]


def classify(x_test: torch.Tensor, y_test: torch.Tensor) -> Callable[[nn.Module], float]:
    def score(model: nn.Module) -> float:
        with torch.no_grad():
            return float((model(x_test).argmax(1) == y_test).float().mean())
    return score


def mlp(seed: int, rank: int, size: int) -> Task:
    """A fixed random teacher (64-128-10, tanh) labels Gaussian inputs (10 classes); 8,192
    training examples split over the ranks, 4,000 held out, batch 128 in all (32 a rank at 4).
    Dense reaches ~80% in its 8 epochs, still learning: lost gradient information shows."""
    g = torch.Generator().manual_seed(1234)
    w1, w2 = torch.randn(64, 128, generator=g) / 16, torch.randn(128, 10, generator=g)
    x, x_test = torch.randn(8192, 64, generator=g), torch.randn(4000, 64, generator=g)
    y, y_test = ((torch.tanh(v @ w1) @ w2).argmax(1) for v in (x, x_test))
    mine, my_y, batch = x[rank::size], y[rank::size], 128 // size

    def model() -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, 10))

    def batches(epoch: int):
        for idx in shuffled(len(mine), batch, seed, epoch):
            yield (mine[idx],), my_y[idx]

    return Task(8, 0.1, model, batches, nn.functional.cross_entropy,
                classify(x_test, y_test), "accuracy")


def digits(seed: int, rank: int, size: int) -> Task:
    """scikit-learn's load_digits: 1,437 training images split over the ranks, 360 held out
    (a fixed split), batch 64 in all; a CNN with two 3x3 convolutions and two linear layers."""
    from sklearn.datasets import load_digits
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    x_test, y_test, x, y = x[-360:], y[-360:], x[:-360], y[:-360]
    mine, my_y, batch = x[rank::size], y[rank::size], 64 // size
    n = min(len(x[r::size]) for r in range(size))  # the same number of steps on every rank

    def model() -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
                             nn.Linear(64, 10))

    def batches(epoch: int):
        for idx in shuffled(n, batch, seed, epoch):
            yield (mine[idx],), my_y[idx]

    return Task(20, 0.05, model, batches, nn.functional.cross_entropy,
                classify(x_test, y_test), "accuracy")


def ctr(seed: int, rank: int, size: int) -> Task:
    """The demo's CTR model at a twentieth of its vocabularies (13k rows x 16): 32,768 training
    examples split over the ranks, 16,384 held out, batch 1,024 in all."""
    from sklearn.metrics import roc_auc_score
    sizes, per_rank = vocab_sizes(0.05), 32768 // size
    shard = make_shard(7, rank, per_rank, sizes)
    held = make_shard(7, 1000, 16384, sizes, tag=1)

    def model() -> nn.Module:
        torch.manual_seed(seed)
        return CTRModel(sizes, 16)

    def batches(epoch: int):
        for idx in shuffled(per_rank, 1024 // size, seed, epoch):
            yield (shard.ids[idx], shard.dense[idx]), shard.label[idx]

    def score(model: nn.Module) -> float:
        with torch.no_grad():
            return float(roc_auc_score(held.label.numpy(), model(held.ids, held.dense).numpy()))

    return Task(4, 1.0, model, batches, nn.functional.binary_cross_entropy_with_logits, score,
                "auc")


LOWER_IS_BETTER = {"nats/byte"}  # metrics where a smaller score is the better one
LM_STEPS = 300  # the run the Adam diagnosis measured; HVD_SPARSE_ACC_LM_STEPS for a reduced one
LM_EVALS = 6  # held-out loss measured this many times over the run (the "epochs")


def stdlib_text() -> tuple[torch.Tensor, torch.Tensor]:
    """Text no one here wrote, shipped with Python: the standard library's top-level ``.py``
    files in sorted order, every 8th held out (a split by file, so held-out text is unseen).

    Returns:
        (training bytes, held-out bytes), uint8 tensors.
    """
    import sysconfig
    from pathlib import Path
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if len(files) < 16:
        raise RuntimeError(f"lm: only {len(files)} .py files in the stdlib directory")
    train_b, held_b = bytearray(), bytearray()
    for i, f in enumerate(files):
        (held_b if i % 8 == 0 else train_b).extend(f.read_bytes())
    return (torch.frombuffer(train_b, dtype=torch.uint8).clone(),
            torch.frombuffer(held_b, dtype=torch.uint8).clone())


class ByteLM(nn.Module):
    """A causal transformer over bytes: embeddings of bytes and positions, pre-norm layers
    (4 heads, feed-forward 2x width, no dropout), a final norm and a linear head to 256 logits.

    Args:
        width: the model's width.
        layers: transformer layers.
        context: the longest input, in bytes.
    """

    def __init__(self, width: int = 128, layers: int = 2, context: int = 64) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, width), nn.Embedding(context, width)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Next-byte logits.

        Args:
            x: int64 bytes, (batch, length <= context).

        Returns:
            Logits (batch, length, 256).
        """
        n = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(n, device=x.device))
        h = self.body(h, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(h))


def next_byte_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of every next byte, in nats."""
    return nn.functional.cross_entropy(logits.reshape(-1, 256), target.reshape(-1))


def lm(seed: int, rank: int, size: int) -> Task:
    """The byte-level LM (docs/notes/adam-accuracy.md): batch 16 windows of 64 bytes per
    rank drawn at random from the training text (each rank its own), Adam lr 3e-3; held-out
    loss on 256 fixed windows of the held-out files (16,384 predicted bytes), in nats per
    byte."""
    context, batch = 64, 16
    text, held = stdlib_text()
    steps = int(os.environ.get("HVD_SPARSE_ACC_LM_STEPS", LM_STEPS))
    lr = float(os.environ.get("HVD_SPARSE_ACC_LM_LR", 3e-3))  # for lr-sensitivity checks
    per_eval = max(1, steps // LM_EVALS)
    starts = torch.randint(0, len(held) - context - 1, (256,),
                           generator=torch.Generator().manual_seed(99))
    held_x = torch.stack([held[s:s + context + 1] for s in starts.tolist()]).long()

    def model() -> nn.Module:
        torch.manual_seed(seed)
        return ByteLM(context=context)

    def batches(epoch: int):
        g = torch.Generator().manual_seed(((seed * 1000 + epoch) * 1000 + rank) * 7 + 1)
        for _ in range(per_eval):
            s = torch.randint(0, len(text) - context - 1, (batch,), generator=g).tolist()
            w = torch.stack([text[i:i + context + 1] for i in s]).long()
            yield (w[:, :-1],), w[:, 1:]

    def score(model: nn.Module) -> float:
        with torch.no_grad():
            return float(next_byte_loss(model(held_x[:, :-1]), held_x[:, 1:]))

    return Task(LM_EVALS, lr, model, batches, next_byte_loss, score, "nats/byte",
                optimizer=lambda params: torch.optim.Adam(params, lr=lr))


TASKS: dict[str, Callable[[int, int, int], Task]] = {"mlp": mlp, "digits": digits, "ctr": ctr,
                                                     "lm": lm}


def sparsifier(method: str, warmup: int, density: float) -> hvd_sparse.Sparsifier | None:
    # HVD_SPARSE_ACC_SMALL=sparse: no tensor goes whole for its size (each sends >= 1 element)
    kw = ({"min_numel": 0, "min_selected": 1}
          if os.environ.get("HVD_SPARSE_ACC_SMALL") == "sparse" else {})
    return {"dense": None, "topk": hvd_sparse.TopK(density, **kw),
            "topkw": hvd_sparse.TopK(density, warmup=warmup, **kw),
            "dgc": hvd_sparse.DGC(density, warmup=warmup, **kw),
            "dgc0": hvd_sparse.DGC(density, **kw),
            # density is per rank: "exdyna" is the paper's setting (the union at density),
            # "exdyna4" sends per rank what TopK and DGC do (a union of density x ranks)
            "exdyna": hvd_sparse.ExDyna(density / hvd.size(), **kw),
            "exdyna4": hvd_sparse.ExDyna(density, **kw)}[method]


def torch_group() -> None:
    """A Gloo process group beside Horovod, for DDP (rank 0 picks the port)."""
    if dist.is_initialized():
        return
    port = 0
    if hvd.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = hvd.broadcast_object(port, root_rank=0, name="accuracy.port")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=hvd.rank(),
                            world_size=hvd.size())


def powersgd_bytes(model: nn.Module, rank: int, size: int) -> float:
    """Per rank per step, ring allreduce model: PowerSGD sends P (n x r) and Q (m x r) for each
    matrix it compresses (those whose n*m exceed (n+m)*r by its min_compression_rate, 2) and
    every other tensor whole."""
    floats = 0
    for p in model.parameters():
        n, m = p.shape[0], p.numel() // p.shape[0]
        small = p.dim() < 2 or n * m <= (n + m) * rank * 2
        floats += p.numel() if small else (n + m) * rank
    return 2 * (size - 1) / size * floats * 4


def _equal(a: object, b: object) -> bool:
    """Whether two state dicts (nested dicts, lists, tensors, numbers) hold the same values."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(
            _equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def train(task_name: str, method: str, seed: int, density: float = DENSITY,
          epochs_x: int = 1, resume_at: int | None = None,
          sparsify: str = "gradient", dense_steps: int = 0) -> dict[str, object]:
    """Trains ``task_name`` with ``method`` (sparsifiers at ``density``) for ``epochs_x`` times
    its epochs; returns scores per epoch and bytes per step. ``sparsify``: what the
    sparsifiers sparsify (``hvd_sparse.DistributedOptimizer``'s argument: "gradient",
    "update" or "frozen"; "frozen-local": "frozen" with ``local_updates``, flushed before
    the last score); ``dense_steps``: its dense warm-up (sparsified methods only; the
    bytes counted). ``resume_at``: after that many
    epochs, checkpoint model and optimizer (the sparsifier's residuals and momentum with it)
    through torch.save/torch.load and go on with a new model, optimizer and sparsifier loaded
    from it, as a restarted job would."""
    task = TASKS[task_name](seed, hvd.rank(), hvd.size())
    task = replace(task, epochs=task.epochs * epochs_x)
    base, wire = method.removesuffix(BF16), "bf16" if method.endswith(BF16) else ""
    if hvd_sparse.basics.state().config.wire != wire:  # a global option: set per run
        hvd_sparse.init(wire=wire)
    model = task.model()
    steps = sum(1 for _ in task.batches(0))
    names = [f"{task_name}.{method}.{seed}.{n}" for n, _ in model.named_parameters()]

    local = sparsify == "frozen-local"
    # the library's default unless HVD_SPARSE_ACC_REFRESH_CAP names one
    cap = os.environ.get("HVD_SPARSE_ACC_REFRESH_CAP")
    frozen_kw = {} if cap is None else {"refresh_cap": int(cap)}

    def ours(model: nn.Module) -> torch.optim.Optimizer:
        sp = sparsifier(base, warmup=2 * steps, density=density)
        return hvd_sparse.DistributedOptimizer(
            task.make_optimizer(list(model.parameters())),
            named_parameters=list(zip(names, model.parameters(), strict=True)), sparsifier=sp,
            scheme="dense" if sp is None else "allgather",
            block_size=None if sp is None else int(os.environ.get("HVD_SPARSE_ACC_BLOCK", 4)),
            sparsify="frozen" if local else sparsify,
            dense_steps=0 if sp is None else dense_steps, local_updates=local and sp is not None,
            **frozen_kw)

    ddp_bytes, restored = None, None
    if base in POWERSGD:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        torch_group()
        # one bucket: the hook all-reduces from callback threads, and two buckets' callbacks
        # may do so in different orders on different ranks (Gloo: the LM hung in its first
        # PowerSGD step with two buckets, DDP's first one capped at 1 MiB by default)
        net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=256)
        opt = task.make_optimizer(list(model.parameters()))
        r = POWERSGD[base]
        # From the second step on (its default waits 1,000 steps with plain allreduce).
        net.register_comm_hook(psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=r, start_powerSGD_iter=2,
            random_seed=seed), psgd.powerSGD_hook)
        ddp_bytes = powersgd_bytes(model, r, hvd.size())
    else:
        net, opt = model, ours(model)
    scores, sent, union, numel = [], 0.0, 0.0, sum(p.numel() for p in model.parameters())
    calls: dict[str, int] = {}  # per reduction name, the calls counted
    prefix = f"{task_name}.{method}.{seed}."

    def count_sent(records: dict[str, dict]) -> float:
        """Bytes of this run's reductions in ``records`` (``hvd_sparse.metrics()``) since the
        last count (a flush's too: name.flush)."""
        new = 0.0
        for k, r in records.items():
            if k.startswith(prefix) and r["calls"] > calls.get(k, 0):
                calls[k] = r["calls"]
                new += r.get("bytes_sent", 0)
        return new

    taken, flush_every = 0, int(os.environ.get("HVD_SPARSE_ACC_FLUSH_EVERY", 0))
    t0 = time.perf_counter()
    for epoch in range(task.epochs):
        net.train()
        for inputs, target in task.batches(epoch):
            opt.zero_grad()
            task.loss(net(*inputs), target).backward()
            opt.step()
            taken += 1
            if local and flush_every and taken % flush_every == 0:
                opt.flush()  # the user's choice of more dense steps for less staleness
            if ddp_bytes is None:
                m = hvd_sparse.metrics()
                sent += count_sent(m)
                union += sum(m[n].get("union", 0) for n in names) if base != "dense" else 0
        if local and epoch + 1 == task.epochs and ddp_bytes is None:
            opt.flush()  # the ranks' own unsent updates averaged in: the same model on all
            sent += count_sent(hvd_sparse.metrics())
        net.eval()
        scores.append(task.score(model))
        if epoch + 1 == resume_at and ddp_bytes is None:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
            buf.seek(0)
            ckpt = torch.load(buf)
            net = model = task.model()
            model.load_state_dict(ckpt["model"])
            with warnings.catch_warnings():  # DGC takes the new SGD's momentum again
                warnings.simplefilter("ignore")
                opt = ours(model)
            opt.load_state_dict(ckpt["opt"])
            key = hvd_sparse.optimizer.SPARSIFIER_KEY
            restored = key in ckpt["opt"] and _equal(opt.state_dict()[key], ckpt["opt"][key])
    total = steps * task.epochs
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    return {"task": task_name, "method": method, "seed": seed, "density": density,
            "sparsify": sparsify, "dense_steps": dense_steps if base in SPARSIFIED else 0,
            "wire": wire or "float32", "refresh_cap": cap,
            "small_tensors": os.environ.get("HVD_SPARSE_ACC_SMALL", "whole"),
            "metric": task.metric, "resumed_at": resume_at, "restored": restored,
            "scores": scores, "score": scores[-1], "steps": total,
            "bytes_per_step": ddp_bytes if ddp_bytes is not None else sent / total,
            "dense_bytes_per_step": 2 * (hvd.size() - 1) / hvd.size() * numel * 4,
            "union_density": union / total / numel if base in SPARSIFIED else None,
            "seconds": time.perf_counter() - t0, "checksum": checksum,
            "finite": all(math.isfinite(s) for s in scores)}


def main() -> None:
    """Under horovodrun: HVD_SPARSE_ACC_RUNS="task:method:seed,..." (sparsifiers at
    HVD_SPARSE_ACC_DENSITY, default 1%, on what HVD_SPARSE_ACC_SPARSIFY says, default "gradient";
    HVD_SPARSE_ACC_EPOCHS_X times each task's epochs, default 1; the language model's steps
    HVD_SPARSE_ACC_LM_STEPS; a dense warm-up of HVD_SPARSE_ACC_DENSE_STEPS steps; the
    sparsified methods' codec block HVD_SPARSE_ACC_BLOCK, default 4; "frozen-local": a flush
    every HVD_SPARSE_ACC_FLUSH_EVERY steps, default none; HVD_SPARSE_ACC_SMALL=sparse: small
    tensors sparsified too; HVD_SPARSE_ACC_REFRESH_CAP: "frozen"'s refresh_cap, default the
    library's)
    -> rank<r>.json
    lines in HVD_SPARSE_TEST_OUT (scripts/checks/convergence.py reads rank 0's)."""
    import json
    from pathlib import Path
    torch.set_num_threads(1)
    hvd.init()
    hvd_sparse.init()
    out = Path(os.environ["HVD_SPARSE_TEST_OUT"]) / f"rank{hvd.rank()}.jsonl"
    for run in os.environ["HVD_SPARSE_ACC_RUNS"].split(","):
        task, method, seed = run.split(":")
        res = train(task, method, int(seed),
                    float(os.environ.get("HVD_SPARSE_ACC_DENSITY", DENSITY)),
                    int(os.environ.get("HVD_SPARSE_ACC_EPOCHS_X", "1")),
                    sparsify=os.environ.get("HVD_SPARSE_ACC_SPARSIFY", "gradient"),
                    dense_steps=int(os.environ.get("HVD_SPARSE_ACC_DENSE_STEPS", "0")))
        with out.open("a") as f:
            f.write(json.dumps(res) + "\n")
        if hvd.rank() == 0:
            print(f"[accuracy] {task} {method} seed {seed}: {res['metric']} "
                  f"{res['score']:.4f}, {res['bytes_per_step']:.0f} B/step, "
                  f"{res['seconds']:.1f} s", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
