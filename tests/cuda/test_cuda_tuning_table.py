"""Tuning per GPU architecture (issue 33, item 4): ``tuning_table.json`` entries keyed by
``device_arch`` ("sm_90", "gfx942") laid over a backend's base ``Tuning`` by ``for_arch``;
``write_entry`` keeps other architectures; the sweep's choice (``tune.best_of``) is the lowest
geometric mean over the cases; the table shipped with the package reads for every entry; a
backend in the CPU test mode runs its base table."""

import json
import types

import numpy as np
import pytest

from kvcache_cuda import tune
from kvcache_cuda.tuning import (CUDA_TUNING, TABLE_PATH, AttnTiles, Tuning, device_arch, for_arch,
                                 read_table, write_entry)


def test_an_entry_overrides_tiles_per_head_dim_and_the_split_rule():
    entry = {"by_head_dim": {"128": {"decode": [16, 64, 4, 2]}},
             "fp8_by_head_dim": {"128": {"prefill": [64, 64, 4, 3]}},
             "split_min_keys": 128, "split_programs_per_sm": 4,
             "source": "a test", "measured": {"anything": 1}}
    t = for_arch(CUDA_TUNING, "sm_90", {"sm_90": entry})
    assert t.tiles("decode", 128) == AttnTiles(16, 64, 4, 2)
    assert t.tiles("decode", 96) == AttnTiles(16, 64, 4, 2)          # 96 runs at 128
    assert t.tiles("prefill", 128) == CUDA_TUNING.tiles("prefill", 128)        # kept
    assert t.tiles("decode", 64) == CUDA_TUNING.tiles("decode", 64)            # kept
    assert t.tiles("prefill", 128, fp8=True) == AttnTiles(64, 64, 4, 3)
    assert t.tiles("decode", 128, fp8=True) == CUDA_TUNING.tiles("decode", 128, fp8=True)
    assert (t.split_min_keys, t.split_programs_per_sm) == (128, 4)
    assert t.split_max == CUDA_TUNING.split_max
    # another architecture, or none (the CPU test mode), keeps the base
    assert for_arch(CUDA_TUNING, "sm_80", {"sm_90": entry}) is CUDA_TUNING
    assert for_arch(CUDA_TUNING, None, {"sm_90": entry}) is CUDA_TUNING


def test_the_ragged_kernel_takes_its_own_tiles_where_an_entry_gives_them():
    """A "ragged" entry is the ragged kernel's tiles for a 16-bit cache; without one, and for
    float32 and fp8 caches (their prefill tiles are sized for their bytes), it runs the
    prefill tiles."""
    assert CUDA_TUNING.tiles("ragged", 128) == CUDA_TUNING.tiles("prefill", 128)
    assert CUDA_TUNING.tiles("ragged", 64) == CUDA_TUNING.tiles("prefill", 64)
    entry = {"by_head_dim": {"128": {"ragged": [128, 64, 8, 3], "prefill": [64, 64, 4, 2]}}}
    t = for_arch(CUDA_TUNING, "sm_90", {"sm_90": entry})
    assert t.tiles("ragged", 128) == t.tiles("ragged", 96) == AttnTiles(128, 64, 8, 3)
    assert t.tiles("prefill", 128) == AttnTiles(64, 64, 4, 2)
    assert t.tiles("ragged", 64) == CUDA_TUNING.tiles("prefill", 64)
    assert t.tiles("ragged", 128, float32=True) == CUDA_TUNING.tiles("prefill", 128, float32=True)
    assert t.tiles("ragged", 128, fp8=True) == AttnTiles(64, 64, 4, 2)


def test_the_cuda_launcher_runs_the_ragged_tiles():
    pytest.importorskip("triton")
    import cuda_cases as cc
    from kvcache_cuda import triton_kernels
    cfg = cc.config(hq=8, hkv=2, d=128, ps=16, dtype="float16")
    _, mine = cc.pair(cfg, "torch")
    mine.tuning = for_arch(CUDA_TUNING, "sm_90", {"sm_90": {"by_head_dim": {"128": {
        "ragged": [64, 32, 4, 2]}}}})
    launch = triton_kernels._Cfg(mine.ctx)
    assert launch.rag_tiles == AttnTiles(64, 32, 4, 2) and launch.rag_m_tok == 16
    assert launch.pre_tiles == CUDA_TUNING.tiles("prefill", 128)


def test_the_cuda_launcher_runs_fp8_prefill_tiles_over_fp8_pages():
    """An ``fp8_by_head_dim`` "prefill" entry gives the paged prefill kernel (and the ragged
    one, which keeps the prefill tiles over fp8 pages) its tiles over fp8 pages; a 16-bit
    cache keeps the 16-bit table's."""
    pytest.importorskip("triton")
    import cuda_cases as cc
    from kvcache_cuda import triton_kernels
    t = for_arch(CUDA_TUNING, "sm_90", {"sm_90": {"fp8_by_head_dim": {"128": {
        "prefill": [64, 64, 4, 2]}}}})
    _, fp8 = cc.pair(cc.config(hq=8, hkv=2, d=128, ps=16, dtype="bfloat16",
                               kv_dtype="float8_e4m3"), "torch")
    fp8.tuning = t
    launch = triton_kernels._Cfg(fp8.ctx)
    assert launch.pre_tiles == launch.rag_tiles == AttnTiles(64, 64, 4, 2)
    _, plain = cc.pair(cc.config(hq=8, hkv=2, d=128, ps=16, dtype="bfloat16"), "torch")
    plain.tuning = t
    assert triton_kernels._Cfg(plain.ctx).pre_tiles == CUDA_TUNING.tiles("prefill", 128)


def test_warp_uniform_scalars_come_from_an_entry_and_only_reach_a_compiled_nvidia_kernel(
        monkeypatch):
    """``warp_uniform_scalars`` (inline PTX in the paged prefill kernel) is off in the base
    tables, an architecture's entry turns it on (the shipped ``sm_90`` entry does: timed on an
    H100), and the launcher passes it to the kernel only where the kernel is compiled for an
    NVIDIA GPU: not under Triton's interpreter (it runs no PTX) and not on ROCm, whatever the
    tuning says."""
    import cuda_cases as cc
    from kvcache_cuda import triton_kernels
    from kvcache_rocm.tuning import ROCM_TUNING
    assert not CUDA_TUNING.warp_uniform_scalars and not ROCM_TUNING.warp_uniform_scalars
    t = for_arch(CUDA_TUNING, "sm_90", {"sm_90": {"warp_uniform_scalars": True}})
    assert t.warp_uniform_scalars and t.tiles("prefill", 128) == CUDA_TUNING.tiles("prefill", 128)
    assert for_arch(CUDA_TUNING, "sm_90", read_table()).warp_uniform_scalars
    assert not for_arch(CUDA_TUNING, "sm_80", read_table()).warp_uniform_scalars
    _, mine = cc.pair(cc.config(hq=8, hkv=2, d=64, ps=16, dtype="bfloat16"), "torch")
    mine.tuning = CUDA_TUNING    # on a GPU the device's own entry would apply
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton_kernels.torch.version, "hip", None)
    assert not triton_kernels._Cfg(mine.ctx).uniform
    mine.tuning = t
    assert triton_kernels._Cfg(mine.ctx).uniform
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not triton_kernels._Cfg(mine.ctx).uniform
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(triton_kernels.torch.version, "hip", "6.4")
    assert not triton_kernels._Cfg(mine.ctx).uniform


@pytest.mark.parametrize("entry,names", [
    ({"warp_uniform_scalars": 1}, "warp_uniform_scalars=1"),
    ({"warp_uniform_scalars": "yes"}, "must be true or false"),
    ({"split_min_keys": 0}, "split_min_keys=0"),
    ({"split_min_keys": True}, "split_min_keys=True"),
    ({"by_head_dim": {"128": {"decode": [16, 64, 4]}}}, "block_rows"),
    ({"by_head_dim": {"128": {"append": [16, 64, 4, 2]}}}, "'append'"),
    ({"by_head_dim": {"x": {"decode": [16, 64, 4, 2]}}}, "'x'"),
    ({"num_warps": 4}, "unknown key 'num_warps'"),
])
def test_an_entry_it_cannot_read_is_refused_naming_the_key(entry, names):
    with pytest.raises(ValueError, match="sm_90") as err:
        for_arch(CUDA_TUNING, "sm_90", {"sm_90": entry}, "table.json")
    assert names in str(err.value) and "table.json" in str(err.value)


def test_write_entry_keeps_the_other_architectures(tmp_path):
    path = tmp_path / "table.json"
    write_entry("gfx942", {"split_min_keys": 512}, path)
    write_entry("sm_90", {"by_head_dim": {"128": {"decode": [16, 128, 8, 3]}}}, path)
    write_entry("sm_90", {"split_programs_per_sm": 2}, path)             # replaces sm_90's
    table = json.loads(path.read_text())
    assert table == {"gfx942": {"split_min_keys": 512}, "sm_90": {"split_programs_per_sm": 2}}
    assert read_table(path) == table
    with pytest.raises(ValueError, match="unknown key"):
        write_entry("sm_80", {"bogus": 1}, path)
    assert "sm_80" not in json.loads(path.read_text())                  # checked first
    assert read_table(tmp_path / "none.json") == {}


def test_the_sweep_picks_the_lowest_geometric_mean_over_the_cases():
    timings = {"a": [10.0, 100.0], "b": [11.0, 80.0], "c": [9.0, 200.0], "d": [8.0, None]}
    best, score = tune.best_of(timings)
    # floors 9 and 80 (d failed a case: out): a 1.111 * 1.25, b 1.222 * 1.0, c 1.0 * 2.5
    assert best == "b" and score == pytest.approx((11 / 9 * 1.0) ** 0.5)
    with pytest.raises(RuntimeError):
        tune.best_of({"x": [None]})


def test_device_arch_names_cuda_and_rocm_architectures():
    def fake(hip, major=9, minor=0, gcn=""):
        props = types.SimpleNamespace(major=major, minor=minor, gcnArchName=gcn)
        return types.SimpleNamespace(
            device=lambda d: types.SimpleNamespace(type=str(d).split(":")[0]),
            version=types.SimpleNamespace(hip=hip),
            cuda=types.SimpleNamespace(get_device_properties=lambda d: props))
    assert device_arch(fake(None), "cuda:0") == "sm_90"
    assert device_arch(fake(None, 8, 6), "cuda") == "sm_86"
    assert device_arch(fake("6.2", gcn="gfx942:sramecc+:xnack-"), "cuda") == "gfx942"
    assert device_arch(fake(None), "cpu") is None


def test_the_shipped_table_reads_for_every_architecture():
    from kvcache_rocm.tuning import ROCM_TUNING
    table = read_table(TABLE_PATH)
    for arch in table:
        for base in (CUDA_TUNING, ROCM_TUNING):
            assert isinstance(for_arch(base, arch, table), Tuning)


def test_the_cpu_test_mode_runs_the_base_table(monkeypatch):
    import kvcache
    from kvcache_cuda.backend import CudaBackend
    monkeypatch.setenv("KVCACHE_CUDA_CPU", "1")
    cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=64,
                              page_size=16, max_total_tokens=64, rope_mode="normal")
    backend = CudaBackend(cfg, "cpu")
    assert backend.arch is None and backend.tuning is CudaBackend.TUNING


@pytest.mark.parametrize("on_factor,hip,expect", [(0.9, None, True), (1.1, None, False),
                                                  (1.0, None, False), (0.9, "6.4", None)])
def test_the_sweep_times_warp_uniform_scalars_where_inline_ptx_reaches_the_kernel(
        monkeypatch, on_factor, hip, expect):
    """The sweep's last step times ``warp_uniform_scalars`` off and on over the paged prefill
    cases (on the chosen prefill tiles) and writes the faster (off on a tie) into the entry, so
    that a new sweep keeps or drops the flag by measurement; where inline PTX cannot reach the
    kernel (ROCm) the entry leaves the flag out. The kernels are not run: a timer stands in."""
    import torch
    from kvcache_cuda import bench, triton_kernels
    from kvcache_cuda.backend import CudaBackend
    monkeypatch.setattr(tune, "DECODE_CASES", [(1, 32), (2, 32)])
    monkeypatch.setattr(tune, "PREFILL_CASES", [("paged", 1, 32), ("paged", 2, 32),
                                                ("ragged", 1, 32)])
    monkeypatch.setattr(tune, "SPLIT_RULES", [(1, 64), (2, 128)])
    monkeypatch.setattr(bench, "DECODE_TILES", bench.DECODE_TILES[:2])
    monkeypatch.setattr(bench, "PREFILL_TILES", bench.PREFILL_TILES[:2])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton_kernels.torch.version, "hip", hip)
    backend = bench.bench_backend(CudaBackend, "bfloat16", "cpu")
    seen = []

    class Timer:                      # paged prefill is faster with the flag by on_factor
        def measure(self, run):
            t = float(run.args[0].shape[0])
            on = backend.tuning.warp_uniform_scalars
            seen.append((run.func.__name__, on))
            if on and run.func.__name__ == "paged_attention" and run.args[0].shape[0] > 2:
                t *= on_factor
            return (t,)

    entry = tune.sweep(torch, backend, Timer(), np.random.default_rng(0), torch.device("cpu"))
    assert entry.get("warp_uniform_scalars") is expect
    assert (("paged_attention", True) in seen) is (hip is None)
    assert not backend.tuning.warp_uniform_scalars            # the base table restored
    for_arch(CUDA_TUNING, "sm_90", {"sm_90": entry})          # the entry reads back
