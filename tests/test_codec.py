"""Block codec and segments against a numpy reference (unit and property tests)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hvd_sparse import _C, blocks

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def ref_mask(x: np.ndarray, bs: int) -> np.ndarray:
    nb = (x.size + bs - 1) // bs
    padded = np.zeros(nb * bs, dtype=np.float64)
    padded[: x.size] = x
    # NaN != 0 is True, so NaN and Inf count as non-zero; -0.0 == 0 counts as zero.
    return (padded.reshape(nb, bs) != 0).any(axis=1) | np.isnan(padded.reshape(nb, bs)).any(axis=1)


@st.composite
def sparse_tensors(draw):
    numel = draw(st.integers(0, 3000))
    bs = draw(st.sampled_from([1, 3, 16, 256]))
    dtype = draw(st.sampled_from(DTYPES))
    density = draw(st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = np.random.default_rng(seed)
    x = g.standard_normal(numel) * (g.random(numel) < density)
    specials = draw(st.lists(st.sampled_from([np.nan, np.inf, -np.inf, -0.0]), max_size=3))
    for v in specials:
        if numel:
            x[g.integers(numel)] = v
    return torch.from_numpy(x).to(dtype), bs


@settings(max_examples=300, deadline=None)
@given(sparse_tensors())
def test_mask_pack_unpack_match_numpy(case):
    t, bs = case
    x = t.double().numpy()
    mask = blocks.block_mask(t, bs).numpy().astype(bool)
    np.testing.assert_array_equal(mask, ref_mask(x, bs))
    idx, vals = blocks.pack(t, bs)
    np.testing.assert_array_equal(idx.numpy(), np.flatnonzero(mask))
    assert vals.shape == (len(idx), bs) and vals.dtype == t.dtype
    # unpack into zeros rebuilds t exactly (NaN where NaN), tail padding dropped
    out = torch.zeros_like(t)
    blocks.unpack(out, idx, vals, bs)
    np.testing.assert_array_equal(out.double().numpy(), np.where(x == 0, 0.0, x))


def ref_sum(ranks: list[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    """What decode_sum promises: +0, plus each rank's values in rank order, in float64 for
    float64 and float32 otherwise, times scale, rounded once to the dtype (numpy arithmetic)."""
    dtype = ranks[0].dtype
    wide = np.float64 if dtype == torch.float64 else np.float32
    acc = np.zeros(ranks[0].numel(), dtype=wide)
    for r in ranks:
        acc = acc + r.to(torch.float64).numpy().astype(wide)
    if scale != 1.0:
        acc = acc * wide(scale)
    return torch.from_numpy(acc).to(dtype)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal values, NaN where NaN, and the same sign on zeros (-0 vs +0)."""
    g, w = got.double().numpy(), want.double().numpy()
    np.testing.assert_array_equal(g, w)
    zeros = w == 0
    np.testing.assert_array_equal(np.signbit(g[zeros]), np.signbit(w[zeros]))


@settings(max_examples=200, deadline=None)
@given(sparse_tensors(), st.integers(1, 5), st.sampled_from([1.0, 0.25, 1 / 3]))
def test_segments_sum_like_numpy(case, nranks, scale):
    t, bs = case
    g = torch.Generator().manual_seed(nranks)
    ranks = [t * torch.randint(0, 2, t.shape, generator=g).to(t.dtype) for _ in range(nranks)]
    code = blocks.DTYPE_CODES[t.dtype]
    buf = torch.cat([_C.encode(r, bs, 42) for r in ranks])
    out = blocks.zeros(t.numel(), t.dtype)
    counts, nnz, union = _C.decode_sum(buf, out, bs, 42, code, t.numel(), nranks, False,
                                       scale=scale)
    masks = [blocks.block_mask(r, bs) for r in ranks]
    assert counts == nnz == [int(m.sum()) for m in masks]
    assert union == int(torch.stack(masks).amax(0).sum())
    assert out.dtype == t.dtype
    assert_same_bits(out, ref_sum(ranks, scale))


@settings(max_examples=150, deadline=None)
@given(sparse_tensors(), st.integers(1, 6))
def test_zen_partitions_are_lossless(case, nparts):
    """zen_encode -> per-partition zen_reduce -> decode equals the plain sum, index 0 included."""
    t, bs = case
    code = blocks.DTYPE_CODES[t.dtype]
    if t.numel():
        t = t.clone()
        t[0] = 3.0
    ranks = [t, torch.roll(t, 1)] if t.numel() else [t, t]
    encoded = [_C.zen_encode(r, bs, nparts, 7) for r in ranks]
    parts = []
    for p in range(nparts):  # what rank p receives from each sender in an alltoall
        chunks = []
        for buf, splits in encoded:
            start = sum(splits[:p])
            chunks.append(buf[start:start + splits[p]])
        parts.append(_C.zen_reduce(torch.cat(chunks), bs, 7, code, t.numel(), len(ranks), p,
                                   nparts, 0))
    out = blocks.zeros(t.numel(), t.dtype)
    counts, _, union = _C.decode_sum(torch.cat(parts), out, bs, 7, code, t.numel(), nparts, True)
    assert sum(counts) == union
    # every block lies in one partition: decoding adds one partition sum to +0
    assert_same_bits(out, ref_sum([ref_sum(ranks)]))


@pytest.mark.parametrize("offset", [1, 3, 4])
def test_segments_at_an_odd_offset_decode_as_aligned(offset):
    """A buffer that does not start on 8 bytes (a view into a larger one) is read as an
    aligned one (copied once, not read as misaligned int32 and float64 arrays: UBSan's
    alignment check under make sanitize-ext)."""
    t = torch.zeros(1000, dtype=torch.float64)
    t[:300] = torch.arange(1.0, 301.0)
    ranks = [t, t.roll(500)]
    buf = torch.cat([_C.encode(r, 64, 5) for r in ranks])
    shifted = torch.empty(buf.numel() + offset, dtype=torch.uint8)[offset:]
    shifted.copy_(buf)
    assert shifted.data_ptr() % 8 != 0
    out = blocks.zeros(t.numel(), t.dtype)
    _C.decode_sum(shifted, out, 64, 5, blocks.DTYPE_CODES[t.dtype], t.numel(), 2, False)
    assert_same_bits(out, ref_sum(ranks))
    part = _C.zen_reduce(shifted, 64, 5, blocks.DTYPE_CODES[t.dtype], t.numel(), 2, 0, 1, 0)
    out = blocks.zeros(t.numel(), t.dtype)
    _C.decode_sum(part, out, 64, 5, blocks.DTYPE_CODES[t.dtype], t.numel(), 1, True)
    assert_same_bits(out, ref_sum(ranks))


def test_partition_hash_is_balanced():
    counts = np.bincount([_C.partition_of(b, 8) for b in range(80_000)], minlength=8)
    assert counts.min() > 0.95 * 10_000 and counts.max() < 1.05 * 10_000
    # clustered indices spread too
    counts = np.bincount([_C.partition_of(b, 4) for b in range(5000, 5400)], minlength=4)
    assert counts.min() >= 70


@pytest.mark.parametrize("corrupt", ["truncate", "magic", "count", "index", "meta", "trailing",
                                     "order"])
def test_malformed_segments_are_rejected_without_writing(corrupt):
    t = torch.zeros(4096)
    t[[0, 700, 3000]] = 1.0
    seg = _C.encode(t, 256, 9).clone()
    hdr = _C.SEGMENT_HEADER_BYTES
    if corrupt == "truncate":
        seg = seg[:-8]
    elif corrupt == "magic":
        seg[0] ^= 0xFF
    elif corrupt == "count":
        seg[12:16] = torch.tensor([200, 0, 0, 0], dtype=torch.uint8)
    elif corrupt == "index":
        seg[hdr:hdr + 4] = torch.tensor([255, 255, 0, 0], dtype=torch.uint8)
    elif corrupt == "meta":
        seg[32] ^= 1
    elif corrupt == "trailing":
        seg = torch.cat([seg, torch.zeros(8, dtype=torch.uint8)])
    elif corrupt == "order":
        seg[hdr:hdr + 8] = seg[hdr:hdr + 8].view(torch.int32).flip(0).view(torch.uint8)
    acc = torch.zeros(4096)
    with pytest.raises(RuntimeError, match="rank 0|trailing"):
        _C.decode_sum(seg, acc, 256, 9, 0, 4096, 1, False)
    assert not acc.any(), "a rejected buffer must not change the output"


@pytest.mark.parametrize("numel", [0, 300])
def test_nothing_to_send_packs_encodes_and_reduces_to_empty(numel):
    """All-zero and empty tensors: no block anywhere. Under `make sanitize-ext` these paths
    once copied 0 bytes from an empty vector's null data(), which UBSan rightly calls
    undefined (pack, encode, zen_reduce)."""
    t = torch.zeros(numel)
    idx, vals = _C.pack(t, 16)
    assert idx.numel() == 0 and vals.shape == (0, 16)
    seg = _C.encode(t, 16, 3)
    out = torch.zeros(numel)
    assert _C.decode_sum(seg, out, 16, 3, 0, numel, 1, False) == ([0], [0], 0)
    buf, splits = _C.zen_encode(t, 16, 2, 3)
    part = _C.zen_reduce(buf[:splits[0]], 16, 3, 0, numel, 1, 0, 2, 0)
    assert int(part[12:16].view(torch.int32)) == 0  # count


def gathered(which: str) -> tuple[torch.Tensor, tuple]:
    """A buffer as other ranks' bytes reach a decoder, and the decoder's other arguments:
    three ranks' allgather segments, what Zen's alltoall brings partition 1 (three ranks'
    index lists) or Zen's allgathered partition sums (bitmaps where dense, index lists)."""
    n, numel, bs = 3, 120, 4
    blocks_ = torch.arange(numel // bs)
    # dense but for one block in partition 2: Zen's partition 2 sum stays an index list
    keep = [b for b in blocks_.tolist() if _C.partition_of(b, n) != 2]
    keep.append(next(b for b in blocks_.tolist() if _C.partition_of(b, n) == 2))
    mask = torch.zeros(numel // bs)
    mask[keep] = 1
    g = torch.Generator().manual_seed(5)
    ranks = [torch.randn(numel, generator=g) * mask.repeat_interleave(bs) for _ in range(n)]
    if which == "allgather":
        return torch.cat([_C.encode(r, bs, 11) for r in ranks]), (numel, bs, n)
    encoded = [_C.zen_encode(r, bs, n, 11) for r in ranks]

    def alltoall(p: int) -> torch.Tensor:
        return torch.cat([buf[sum(sp[:p]):sum(sp[:p + 1])] for buf, sp in encoded])
    if which == "zen_alltoall":
        return alltoall(1), (numel, bs, n)
    parts = [_C.zen_reduce(alltoall(p), bs, 11, 0, numel, n, p, n, 0) for p in range(n)]
    assert [int(part[6]) for part in parts] == [1, 1, 0]  # both kinds: bitmap, index list
    return torch.cat(parts), (numel, bs, n)


def segments(buf: torch.Tensor, bs: int) -> list[tuple[int, int, int]]:
    """(start, start of the values, end) of each segment in ``buf`` (float32 values)."""
    out, at = [], 0
    while at < buf.numel():
        nbytes = int(buf[at + 40:at + 48].view(torch.int64))
        count = int(buf[at + 12:at + 16].view(torch.int32))
        out.append((at, at + nbytes - count * bs * 4, at + nbytes))
        at += nbytes
    return out


@pytest.mark.parametrize("which", ["allgather", "zen_alltoall", "zen_allgather"])
def test_every_changed_byte_and_cut_is_rejected_or_decoded_in_bounds(which):
    """Every single-byte change (two flips per byte) of the segments' headers, index lists and
    bitmaps, and every truncation, of segments from other ranks: the decoder either takes them
    or raises RuntimeError having written nothing; never an allocation sized by a forged field
    (a partition count of 2^31 asked for 48 GiB). Under `make sanitize-ext` any read or write
    out of bounds is fatal."""
    buf, (numel, bs, n) = gathered(which)

    def decode(b: torch.Tensor) -> None:
        if which == "zen_alltoall":
            _C.zen_reduce(b, bs, 11, 0, numel, n, 1, n, 0)
            return
        out = torch.zeros(numel)
        try:
            _C.decode_sum(b, out, bs, 11, 0, numel, n, which == "zen_allgather")
        except RuntimeError:
            assert not out.any(), "a rejected buffer must not change the output"
            raise

    decode(buf)
    cases = [buf[:k] for k in range(buf.numel())]
    for start, values, _ in segments(buf, bs):
        for at in range(start, values):
            for flip in (0x01, 0x80):
                b = buf.clone()
                b[at] ^= flip
                cases.append(b)
    rejected = 0
    for b in cases:
        try:
            decode(b)
        except RuntimeError:
            rejected += 1
    assert rejected >= buf.numel(), rejected  # every cut, at least


def test_forged_partition_count_is_refused_before_any_allocation():
    """The first partition bitmap of Zen's partition sums claims 2^31 partitions: refused by
    its count, not by a failed 48 GiB allocation of their positions."""
    buf, (numel, bs, n) = gathered("zen_allgather")
    at = segments(buf, bs)[0][0]
    assert int(buf[at + 6]) == 1, "a partition bitmap"
    buf[at + 20:at + 24] = torch.tensor([2 ** 31], dtype=torch.int64).view(torch.uint8)[:4]
    with pytest.raises(RuntimeError, match="partition count"):
        _C.decode_sum(buf, torch.zeros(numel), bs, 11, 0, numel, n, True)


def test_mismatch_message_names_rank_and_shapes():
    a, b = _C.encode(torch.ones(300), 256, 1), _C.encode(torch.ones(301), 256, 1)
    with pytest.raises(RuntimeError, match=r"rank 1 has numel=301.*this rank has numel=300"):
        _C.decode_sum(torch.cat([a, b]), torch.zeros(300), 256, 1, 0, 300, 2, False)


def test_pack_is_zero_copy_friendly_on_large_tensors():
    t = torch.zeros(10_000_019)
    t[::100_003] = 2.0
    idx, vals = blocks.pack(t, 256)
    out = torch.zeros_like(t)
    blocks.unpack(out, idx, vals, 256)
    assert torch.equal(out, t)


@settings(max_examples=150, deadline=None)
@given(sparse_tensors(), st.integers(1, 4), st.sampled_from([1.0, 0.25, 3.0]))
def test_in_place_decode_equals_zeroed_decode(case, nranks, scale):
    """What allreduce_ does: clear -0 blocks while masking, then decode over the rank's own
    input, rewriting only the carried blocks. Same bits as decoding into zeros."""
    t, bs = case
    g = torch.Generator().manual_seed(nranks)
    ranks = [t * torch.randint(0, 2, t.shape, generator=g).to(t.dtype) for _ in range(nranks)]
    ranks[0] = torch.where(ranks[0] == 0, torch.tensor(-0.0, dtype=t.dtype), ranks[0])
    code = blocks.DTYPE_CODES[t.dtype]
    own = ranks[0].clone()
    mask = _C.block_mask(own, bs, True)
    assert torch.equal(mask, blocks.block_mask(ranks[0], bs))
    # values unchanged; only -0 in all-zero blocks became +0
    assert torch.allclose(own, ranks[0], rtol=0, atol=0, equal_nan=True)
    buf = torch.cat([_C.encode(r, bs, 5) for r in ranks])
    _C.decode_sum(buf, own, bs, 5, code, t.numel(), nranks, False, scale=scale)
    assert_same_bits(own, ref_sum(ranks, scale))


# Fresh zeros: large outputs are new mappings that only the decode's writes fault in.
FRESH_NUMEL = 2**21 + 77  # over the 4 MiB threshold for every dtype, with a ragged end


@pytest.mark.parametrize("dtype", DTYPES)
def test_fresh_zeros_are_zero_and_writable(dtype):
    for numel in (0, 1, 1000, FRESH_NUMEL):
        z = blocks.zeros(numel, dtype)
        assert z.shape == (numel,) and z.dtype == dtype and z.is_contiguous()
        assert not z.view(torch.uint8).any(), "every byte +0 (no -0, no garbage)"
        z.fill_(-1.5)
        assert bool((z == -1.5).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_fresh_zeros_after_free_are_zero_again(dtype):
    """A freed mapping is reused for the next tensor of its size only once no tensor or view
    holds it, and zeroed first; mappings are not leaked (the resident set does not grow by what
    was written)."""
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = rss()
    for _ in range(12):
        z = blocks.zeros(FRESH_NUMEL, dtype)
        assert not z.view(torch.uint8).any()
        z.fill_(float("nan"))
        keep = z[10:20]  # a view keeps the mapping alive after z is gone
        del z
        assert bool(keep.isnan().all())
        del keep
    a = blocks.zeros(FRESH_NUMEL, dtype)
    a.fill_(1)
    b = blocks.zeros(FRESH_NUMEL, dtype)
    assert b.data_ptr() != a.data_ptr() and not b.view(torch.uint8).any()
    where = a.data_ptr()
    del a
    c = blocks.zeros(FRESH_NUMEL, dtype)
    assert c.data_ptr() == where, "the freed mapping was not reused"
    assert not c.view(torch.uint8).any(), "a reused mapping must be zeroed"
    del b, c
    leak = rss() - before  # 14 such tensors were written
    assert leak < 3 * FRESH_NUMEL * torch.finfo(dtype).bits // 8, "fresh_zeros leaks mappings"


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_into_fresh_zeros_writes_only_the_union(dtype):
    """Out of place: the result is exactly the reference in carried blocks and +0 everywhere
    else, -0 inputs included (in all-zero blocks and inside carried ones)."""
    bs, nranks = 256, 3
    g = np.random.default_rng(int(blocks.DTYPE_CODES[dtype]))
    nb = -(-FRESH_NUMEL // bs)
    ranks = []
    for _ in range(nranks):
        x = np.zeros(nb * bs)
        chosen = g.random(nb) < 0.01
        x.reshape(nb, bs)[chosen] = g.standard_normal((int(chosen.sum()), bs))
        x[g.random(x.size) < 0.1] = -0.0
        ranks.append(torch.from_numpy(x[:FRESH_NUMEL].copy()).to(dtype))
    buf = torch.cat([_C.encode(r, bs, 3) for r in ranks])
    out = blocks.zeros(FRESH_NUMEL, dtype)
    _, _, union = _C.decode_sum(buf, out, bs, 3, blocks.DTYPE_CODES[dtype], FRESH_NUMEL, nranks,
                                False, scale=0.5)
    masks = torch.stack([blocks.block_mask(r, bs) for r in ranks]).amax(0).bool()
    assert union == int(masks.sum()) > 0
    outside = ~masks.repeat_interleave(bs)[:FRESH_NUMEL]
    assert not out[outside].view(torch.uint8).any(), "+0 outside the union of non-zero blocks"
    assert_same_bits(out, ref_sum(ranks, 0.5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [3000, FRESH_NUMEL])
def test_sparse_inputs_densify_with_duplicates_summed_once(dtype, numel):
    """allreduce of a COO tensor densifies it in fresh zeros: duplicates summed in float32
    (float64 for float64) in input order and rounded once (``to_dense`` adds 16-bit ones in
    16 bits), -0 values added to +0; plain and hybrid (nn.Embedding's gradients)."""
    from hvd_sparse.reduction import densified

    g = torch.Generator().manual_seed(numel)
    rows, k = numel // 8, numel // 50
    idx = torch.randint(0, rows, (1, k), generator=g)
    vals = torch.randn(k, 8, generator=g).to(dtype)
    vals[::7] = -0.0
    hybrid = torch.sparse_coo_tensor(idx, vals, (rows, 8))  # uncoalesced: repeated rows
    plain = hybrid.to_dense().to_sparse()
    wide = np.float64 if dtype == torch.float64 else np.float32
    for coo in (hybrid, plain):
        k = coo.sparse_dim()
        where = np.ravel_multi_index(tuple(coo._indices().numpy()), tuple(coo.shape[:k]))
        acc = np.zeros((int(np.prod(coo.shape[:k])), int(np.prod(coo.shape[k:]))), dtype=wide)
        np.add.at(acc, where, coo._values().double().numpy().reshape(len(where), -1).astype(wide))
        got = densified(coo)
        assert got.shape == coo.shape and got.dtype == dtype
        assert_same_bits(got.reshape(-1), torch.from_numpy(acc).to(dtype).reshape(-1))
