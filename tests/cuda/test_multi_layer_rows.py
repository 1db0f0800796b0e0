"""A transfer's row kernels in one launch for every layer: ``gather_kv`` without fp8 scales and
``append_kv_layers`` reach layer ``l``'s pages at layer 0's pointer plus an element offset from a
device table (the layers are separate allocations). Checked bit for bit against the per-layer
kernels (``gather_rows`` / ``append_kv`` per layer) and against plain indexing of the pages, and
through the cache API (layer groups of ``export_sequences``, ``reserve_import`` /
``write_import`` / ``commit_import``).

Modes as in the rest of tests/cuda (conftest.py): the torch kernels on CPU (CI), the Triton
kernels on a GPU, and the Triton kernels through Triton's interpreter, which
``test_the_triton_kernels_pass_under_the_interpreter`` runs here in a child pytest (the
interpreter must be set before Triton is imported). The interpreter runs every program in numpy
(a few ms each), so there it takes the slim pairwise case list below, not the whole grid."""

from __future__ import annotations

import itertools
import re
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

import background_runs
import cuda_cases as cc
import kvcache

torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent / "transfer"))          # tests/ has no packages
from transfer_cases import build_workload, config as transfer_config  # noqa: E402

MODULES = ["torch", "triton"] if cc.ON_GPU else ["triton"] if cc.INTERPRET else ["torch"]
# (Hkv, head_dim, page_size, dtype, layers, tokens)
GRID = list(itertools.product([1, 3, 8], [16, 64], [4, 16], ["bfloat16", "float32"], [1, 5],
                              [1, 37]))
# every pair of values of any two parameters at least once (greedy covering of GRID), with one
# case of several layers *and* several tokens: the interpreter's case list
PAIRWISE = [(1, 64, 4, "float32", 1, 1), (3, 16, 16, "bfloat16", 5, 1),
            (8, 64, 16, "bfloat16", 1, 37), (8, 16, 4, "float32", 5, 37),
            (1, 16, 16, "float32", 1, 37), (3, 64, 4, "float32", 1, 37),
            (1, 64, 4, "bfloat16", 5, 1), (8, 64, 4, "bfloat16", 1, 1)]
CASES = PAIRWISE if cc.INTERPRET else GRID
# more: Dv != D, and 2 heads a program (3 heads: two head blocks, the second half masked)
EXTRA = [dict(hkv=3, d=64, dv=32, ps=4, dtype="float32", layers=3, tokens=6, heads=2)]
POISON = {2: 0x7FA5, 4: 0x7FC0_BEEF}          # NaN bit patterns no random value has


def _case_id(case):
    hkv, d, ps, dtype, layers, tokens = case
    return f"h{hkv}-d{d}-ps{ps}-{dtype}-L{layers}-T{tokens}"


def _cases():
    out = [pytest.param(dict(hkv=h, d=d, dv=d, ps=ps, dtype=dt, layers=n, tokens=t, heads=8),
                        id=_case_id((h, d, ps, dt, n, t)))
           for h, d, ps, dt, n, t in CASES]
    return out + [pytest.param(c, id=f"dv{c['dv']}-heads{c['heads']}") for c in EXTRA]


def _kernels(name):
    if name == "triton":
        return pytest.importorskip("kvcache_cuda.triton_kernels")
    from kvcache_cuda import torch_kernels
    return torch_kernels


def _ctx(c):
    import dataclasses

    from kvcache_cuda.backend import KernelCtx
    from kvcache_cuda.launch import LaunchCache
    from kvcache_cuda.tuning import CUDA_TUNING
    tuning = dataclasses.replace(CUDA_TUNING, elementwise_heads=c["heads"])
    return KernelCtx(c["ps"], c["hkv"], c["hkv"], c["d"], 1, getattr(torch, c["dtype"]), tuning,
                     4, LaunchCache(), c["dv"])


def _gen(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _rand(gen, shape, dtype):
    return torch.randn(shape, generator=gen).to(dtype).to(cc.DEVICE)


def _bits(t):
    t = t.detach().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]).cpu()


def _same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _layers(c, pool, gen, poison=False):
    """``c['layers']`` page arrays, each its own allocation, in an order whose offsets from
    the first have both signs (3 layers or more): the kernels add negative offsets too."""
    dtype = getattr(torch, c["dtype"])
    shape = (pool, 2, c["hkv"], c["ps"], max(c["d"], c["dv"]))
    pages = [_rand(gen, shape, dtype) for _ in range(c["layers"])]
    if poison:
        for p in pages:
            _bits_view(p).fill_(POISON[p.element_size()])
    by_addr = sorted(pages, key=lambda p: p.data_ptr())
    first = by_addr[len(by_addr) // 2]
    pages = [first] + [p for p in pages if p is not first]
    if len(pages) >= 3:
        offsets = [p.data_ptr() - first.data_ptr() for p in pages]
        assert min(offsets) < 0 < max(offsets)
    return pages


def _bits_view(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _slots(c, pool, gen, skips=0):
    """``tokens`` distinct slots in random order over the pool's pages, ``skips`` of them -1."""
    s = torch.randperm(pool * c["ps"], generator=gen)[:c["tokens"]].to(torch.int32)
    if skips and c["tokens"] > 2:
        s[torch.randperm(c["tokens"], generator=gen)[:skips]] = -1
    return s.to(cc.DEVICE)


def _rows(c, pages, slots):
    """(k, v) at ``slots`` of one layer by plain indexing: the oracle."""
    s = slots.long()
    page, row = s // c["ps"], s % c["ps"]
    return pages[page, 0, :, row, :c["d"]], pages[page, 1, :, row, :c["dv"]]


# ---------------------------------------------------------------------- the kernels
@pytest.mark.parametrize("mod", MODULES)
@pytest.mark.parametrize("c", _cases())
def test_one_launch_gather_equals_the_per_layer_gather(mod, c):
    km = _kernels(mod)
    ctx = _ctx(c)
    gen = _gen("gather", mod, sorted(c.items()))
    pool = 37 // c["ps"] + 4
    pages = _layers(c, pool, gen)
    slots = _slots(c, pool, gen)
    k, v = km.gather_kv(ctx, pages, slots)
    n, dtype = c["tokens"], getattr(torch, c["dtype"])
    assert tuple(k.shape) == (c["layers"], n, c["hkv"], c["d"]) and k.dtype == dtype
    assert tuple(v.shape) == (c["layers"], n, c["hkv"], c["dv"]) and v.dtype == dtype
    for layer, p in enumerate(pages):
        rk, rv = km.gather_rows(ctx, p, slots)           # the per-layer launch
        assert _same(k[layer], rk) and _same(v[layer], rv), f"layer {layer}"
        ok, ov = _rows(c, p, slots)
        assert _same(k[layer], ok) and _same(v[layer], ov), f"layer {layer} vs indexing"


@pytest.mark.parametrize("mod", MODULES)
@pytest.mark.parametrize("c", _cases())
def test_append_kv_layers_writes_what_per_layer_append_kv_writes(mod, c):
    km = _kernels(mod)
    ctx = _ctx(c)
    gen = _gen("append", mod, sorted(c.items()))
    pool = 37 // c["ps"] + 4
    dtype = getattr(torch, c["dtype"])
    one = _layers(c, pool, gen, poison=True)
    per_layer = [p.clone() for p in one]
    want = [p.clone() for p in one]
    slots = _slots(c, pool, gen, skips=2)
    n, hkv = c["tokens"], c["hkv"]
    # k a strided view (heads 1.. of a wider array), as a received buffer's slice may be
    k = _rand(gen, (c["layers"], n, hkv + 1, c["d"]), dtype)[:, :, 1:]
    v = _rand(gen, (c["layers"], n, hkv, c["dv"]), dtype)
    km.append_kv_layers(ctx, one, k, v, slots)
    for layer in range(c["layers"]):
        km.append_kv(ctx, per_layer[layer], k[layer], v[layer], slots)
    keep = (slots >= 0).cpu()
    s = slots.cpu().long()[keep].to(cc.DEVICE)
    page, row = s // c["ps"], s % c["ps"]
    for layer in range(c["layers"]):
        w = want[layer]
        w[page, 0, :, row, :c["d"]] = k[layer][keep.to(cc.DEVICE)]
        w[page, 1, :, row, :c["dv"]] = v[layer][keep.to(cc.DEVICE)]
        # whole page arrays: the rows written, every other element still the poison
        assert _same(one[layer], per_layer[layer]), f"layer {layer} vs per-layer append_kv"
        assert _same(one[layer], w), f"layer {layer} vs indexing"


def test_the_default_append_kv_layers_is_append_kv_per_layer():
    """``Backend.append_kv_layers``' default (the reference backend keeps it)."""
    from kvcache.reference import ReferenceBackend
    cfg = cc.config(hkv=2, d=16, ps=4, layers=3)
    ref = ReferenceBackend(cfg)
    rng = np.random.default_rng(3)
    pages = [rng.standard_normal(ref.page_shape(4)).astype(np.float32) for _ in range(3)]
    want = [p.copy() for p in pages]
    k, v = (rng.standard_normal((3, 5, 2, 16)).astype(np.float32) for _ in range(2))
    slots = np.array([9, -1, 0, 15, 4], np.int32)
    ref.append_kv_layers(pages, k, v, slots)
    for layer in range(3):
        ref.append_kv(want[layer], k[layer], v[layer], slots)
        assert want[layer].tobytes() == pages[layer].tobytes()


@pytest.mark.skipif(not (cc.INTERPRET or cc.ON_GPU), reason="the Triton launchers' tables")
def test_offset_tables_are_built_once_per_layer_list_and_any_alignment_works():
    """One table per list of page arrays (a cache's layers and each layer group of its
    transfers), reused by later calls; page arrays at offsets that are no multiple of 16
    elements (views into one buffer here) take the unhinted kernel and still read and write
    the right rows."""
    tk = _kernels("triton")
    c = dict(hkv=2, d=16, dv=16, ps=4, dtype="float32", layers=4, tokens=5, heads=8)
    ctx = _ctx(c)
    gen = _gen("tables")
    pages = _layers(c, 4, gen)
    slots = _slots(c, 4, gen)
    lists = [pages, pages[1:3], pages[::-1]]
    for ps in lists:
        k, _ = tk.gather_kv(ctx, ps, slots)
        assert all(_same(k[i], _rows(c, p, slots)[0]) for i, p in enumerate(ps))
    tables = ctx.launch.static["layer_offsets"]
    assert len(tables) == 3 and all(aligned for _, aligned in tables.values())
    before = {key: t.data_ptr() for key, (t, _) in tables.items()}
    tk.gather_kv(ctx, pages[1:3], slots)
    assert {key: t.data_ptr() for key, (t, _) in tables.items()} == before     # no rebuild
    # four layers carved out of one buffer 3 elements apart (plus whole pages)
    shape = (4, 2, 2, 4, 16)
    size = int(np.prod(shape))
    flat = _rand(gen, (4 * size + 16,), torch.float32)
    carved = [flat[i * (size + 3):i * (size + 3) + size].view(shape) for i in range(4)]
    k, v = tk.gather_kv(ctx, carved, slots)
    assert not tables[(carved[0].device, tuple(p.data_ptr() for p in carved))][1]
    for i, p in enumerate(carved):
        ok, ov = _rows(c, p, slots)
        assert _same(k[i], ok) and _same(v[i], ov)
    want = [p.clone() for p in carved]
    kk, vv = _rand(gen, (4, 5, 2, 16), torch.float32), _rand(gen, (4, 5, 2, 16), torch.float32)
    tk.append_kv_layers(ctx, carved, kk, vv, slots)
    for i in range(4):
        tk.append_kv(ctx, want[i], kk[i], vv[i], slots)
        assert _same(carved[i], want[i])


# ---------------------------------------------------------------------- through the cache
CACHE_DTYPES = ["float32"] if cc.INTERPRET else ["float32", "bfloat16"]
GROUPS = [range(0, 1), range(1, 3), range(3, 4)]


def _caches(impl, dtype, rng):
    """A reference cache with a workload of forks, sliding windows and partial pages, and a
    cuda cache holding the same sequences (imported: ``append_kv_layers``)."""
    cfg = transfer_config(page_size=4, dtype=dtype, rope_mode="none", sliding=True, layers=4)
    ref = kvcache.PagedKVCache(cfg, backend="reference")
    small = cc.INTERPRET           # the interpreter runs each program in numpy
    wl = build_workload(ref, rng, count=4 if small else 8, max_len=10 if small else 30)
    mine = kvcache.PagedKVCache(cfg, backend="cuda", device=cc.DEVICE)
    mine.backend.impl = impl
    for sid in wl.ids:
        if sid in wl.forks:
            parent, pos = wl.forks[sid]
            mine.import_sequence(sid, ref.export_sequence(sid, pos), parent_id=parent)
        else:
            mine.import_sequence(sid, ref.export_sequence(sid))
    return ref, mine, wl.ids


def _host(cache, a):
    from kvcache.arrays import to_host
    return torch.from_numpy(np.ascontiguousarray(to_host(a, cache.config.dtype).view(np.uint8)))


def _same_host(cache_a, a, cache_b, b) -> bool:
    return torch.equal(_host(cache_a, a), _host(cache_b, b))


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_layer_groups_of_an_export_equal_the_whole_export(impl, dtype):
    ref, mine, ids = _caches(impl, dtype, np.random.default_rng(5))
    _, k, v = mine.export_sequences(ids)
    _, rk, rv = ref.export_sequences(ids)
    assert _same_host(mine, k, ref, rk) and _same_host(mine, v, ref, rv)
    for layers in GROUPS:
        _, gk, gv = mine.export_sequences(ids, layers=layers)
        part = slice(layers.start, layers.stop)
        assert tuple(gk.shape) == (len(layers),) + tuple(k.shape[1:])
        assert _same_host(mine, gk, mine, k[part]), layers
        assert _same_host(mine, gv, mine, v[part]), layers


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_a_reserved_import_written_in_layer_groups_reproduces_get_kv(impl, dtype):
    ref, mine, ids = _caches(impl, dtype, np.random.default_rng(6))
    dst = kvcache.PagedKVCache(mine.config, backend="cuda", device=cc.DEVICE)
    dst.backend.impl = impl
    headers, _, _ = mine.export_sequences(ids)
    res = dst.reserve_import([(sid, h, None, None) for sid, h in zip(ids, headers)])
    for layers in GROUPS[::-1]:                  # any order of groups
        _, k, v = mine.export_sequences(ids, layers=layers)
        dst.write_import(res, k, v, layers=layers)
    dst.commit_import(res)
    for sid in ids:          # (the source equals the reference: the test above)
        assert dst.sequence_length(sid) == ref.sequence_length(sid)
        for a, r in zip(dst.get_kv(sid), ref.get_kv(sid)):
            assert _same_host(dst, a, ref, r), sid
    for layer in (0, 3):                 # a single layer's table
        for a, r in zip(dst.get_kv(ids[-1], layer=layer), ref.get_kv(ids[-1], layer=layer)):
            assert _same_host(dst, a, ref, r), layer


# ---------------------------------------------------------------------- the interpreter run
if not (cc.INTERPRET or cc.ON_GPU):
    # background_runs.py: the child starts when collection ends and runs on the second core
    background_runs.register(
        "test_the_triton_kernels_pass_under_the_interpreter",
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         str(Path(__file__).resolve())],
        background_runs.clean_env(TRITON_INTERPRET="1", KVCACHE_CUDA_CPU="1"),
        cwd=HERE.parent.parent, timeout=600, needs=("triton",))


@pytest.mark.skipif(cc.INTERPRET or cc.ON_GPU, reason="the spawner; it runs in CPU mode only")
def test_the_triton_kernels_pass_under_the_interpreter():
    """This file's tests on the Triton kernels through Triton's interpreter, in a child pytest
    (TRITON_INTERPRET must be set before Triton is imported)."""
    pytest.importorskip("triton")
    # the child (registered below) started when collection ended, on the second core
    r = background_runs.result("test_the_triton_kernels_pass_under_the_interpreter")
    tail = r.stdout[-6000:] + r.stderr[-3000:]
    assert r.returncode == 0, tail
    passed = re.search(r"(\d+) passed", r.stdout)
    want = 2 * (len(PAIRWISE) + len(EXTRA)) + 2 + 2 * 1
    assert passed and int(passed.group(1)) == want, tail
