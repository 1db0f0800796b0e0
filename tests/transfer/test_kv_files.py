"""KV files (``cache.save_sequences`` / ``cache.load_sequences``, ``kvcache.files``):

* a file written on one backend loads on every other, bit for bit (reference, cuda's CPU test
  mode, metal on MLX's CPU device; float32 and bfloat16, forks and partial pages), and the
  token ids it carries put the loaded sequences' full pages in the prefix index;
* every corruption is refused with a typed error naming what failed, and the cache keeps what
  it had: a flipped byte in each part of the file (the container header, the file header's
  fields, the token ids, the page hashes, the payload header, K, V), a truncation at every
  boundary, another format version, another model fingerprint, a cache of other geometry,
  and a cache with room for only some of the sequences (all or nothing).
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

import kvcache
from kvcache.errors import (CacheFullError, InvalidArgumentError, KVCacheError,
                            UnsupportedFeatureError)
from kvcache.files import read_header

from transfer_cases import (assert_same_kv, build_workload, caches_here, config, make_cache,
                            run_forward, snapshot)

BACKENDS = ["reference", "cuda", "metal"]


def _saved(tmp_path, backend="reference", dtype="float32", count=6, seed=0):
    """A cache with a workload of ``count`` sequences on ``backend``, and a file of all of them
    with token ids for every other one."""
    src = make_cache(backend, config(dtype=dtype, prefix_cache=True))
    rng = np.random.default_rng(seed)
    work = build_workload(src, rng, count=count, windows=False)
    tokens = [rng.integers(1, 500, src.sequence_length(s)).tolist() if i % 2 == 0 else None
              for i, s in enumerate(work.ids)]
    path = tmp_path / f"{backend}-{dtype}.kv"
    src.save_sequences(path, work.ids, tokens=tokens, fingerprint={"model": "test", "layers": 2})
    return src, work.ids, tokens, path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("src_backend", BACKENDS)
def test_a_file_loads_on_every_backend_bit_for_bit(tmp_path, src_backend, dtype):
    src, ids, tokens, path = _saved(tmp_path, src_backend, dtype)
    for _, dst in caches_here(BACKENDS, lambda: config(dtype=dtype, prefix_cache=True)):
        dst.add_sequence(5)                             # ids are taken after the largest
        new = dst.load_sequences(path, fingerprint={"layers": 2, "model": "test"})
        assert new == list(range(6, 6 + len(ids)))
        for sid, did in zip(ids, new):
            assert_same_kv(src, sid, dst, did)
        # a loaded sequence with ids has its full pages in the prefix index
        t = tokens[0]
        ps = dst.config.page_size
        assert dst.match_prefix(t + [1]) == len(t) // ps * ps
    header = read_header(path)
    assert header["page_size"] == 4 and len(header["sequences"]) == len(ids)
    assert [len(e["pages"]) for e in header["sequences"]] == \
        [-(-src.sequence_length(s) // 4) for s in ids]


def test_loading_continues_the_sequence_as_if_it_never_left(tmp_path):
    """A loaded sequence attends to the same keys: a forward over it gives the outputs the
    source's gives."""
    src = make_cache("reference", config())
    rng = np.random.default_rng(3)
    src.add_sequence(1)
    run_forward(src, [1], [37], rng)
    path = tmp_path / "one.kv"
    src.save_sequences(path, [1])
    dst = make_cache("reference", config())
    (did,) = dst.load_sequences(path, seq_ids=[9])
    c = src.config
    qkv = [tuple(rng.standard_normal((3, h, c.head_dim)).astype(np.float32)
                 for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads))
           for _ in range(c.num_layers)]
    a = run_forward(src, [1], [3], rng, return_output=True, qkv=qkv)
    b = run_forward(dst, [did], [3], rng, return_output=True, qkv=qkv)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def _regions(path) -> dict:
    """Byte offsets in the file of each part the adversarial test flips."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    table = json.loads(raw[8:8 + n])
    head = raw[8:8 + n].decode()
    meta = table["__metadata__"]["kvcache"]
    at = head.index(json.dumps(meta)[1:20])        # where the file header's text starts

    def field(text):
        return 8 + head.index(text, at)
    start = 8 + n
    entry = json.loads(meta)["sequences"][0]
    k0 = table[entry["k"]]["data_offsets"][0]
    v0 = table[entry["v"]]["data_offsets"][0]
    return {"container length": 3, "tensor table": 12,
            "format": field("kvcache-kv-file"), "page_size": field('page_size\\":') + 12,
            "token ids": field('tokens\\":[') + 10, "page hash": field('pages\\":[\\"') + 12,
            "payload header": field('num_kv_heads\\":') + 15,
            "K": start + k0 + 5, "V": start + v0 + 7}


REASONS = {"container length": "header length", "tensor table": "not in the file",
           "format": "format=", "page_size": "fails its hash", "token ids": "fails its hash",
           "page hash": "fails its hash", "payload header": "num_kv_heads",
           "K": "page 0 (tokens 0..) fails its hash", "V": "page 0 (tokens 0..) fails its hash"}
"""What each flipped part is refused for (the K/V flips meet the page hashes, which cover
everything the payload's CRC-32 covers: the CRC is not computed again)."""


@pytest.mark.parametrize("part", list(REASONS))
def test_a_flipped_byte_anywhere_is_refused_and_nothing_changes(tmp_path, part):
    _, ids, _, path = _saved(tmp_path, count=3)
    raw = bytearray(path.read_bytes())
    at = _regions(path)[part]
    raw[at] ^= 0x01 if part not in ("K", "V") else 0x40
    bad = tmp_path / "bad.kv"
    bad.write_bytes(bytes(raw))
    dst = make_cache("reference", config(prefix_cache=True))
    dst.add_sequence(1)
    run_forward(dst, [1], [9], np.random.default_rng(1))
    before = snapshot(dst)
    with pytest.raises(KVCacheError) as info:
        dst.load_sequences(bad)
    assert isinstance(info.value, InvalidArgumentError), info.value
    assert REASONS[part] in str(info.value) and "nothing was loaded" in str(info.value)
    assert snapshot(dst) == before


def test_a_truncated_file_is_refused_at_every_boundary(tmp_path):
    _, _, _, path = _saved(tmp_path, count=2)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    cuts = sorted({0, 4, 8, 9, 8 + n // 2, 8 + n, 8 + n + 1, (8 + n + len(raw)) // 2,
                   len(raw) - 1})
    dst = make_cache("reference", config())
    before = snapshot(dst)
    for cut in cuts:
        bad = tmp_path / f"cut{cut}.kv"
        bad.write_bytes(raw[:cut])
        with pytest.raises(InvalidArgumentError, match="nothing was loaded"):
            dst.load_sequences(bad)
        assert snapshot(dst) == before, cut


def test_mismatches_name_the_field_and_change_nothing(tmp_path):
    _, ids, _, path = _saved(tmp_path, count=3)
    dst = make_cache("reference", config())
    before = snapshot(dst)
    with pytest.raises(InvalidArgumentError, match="fingerprint field 'model'"):
        dst.load_sequences(path, fingerprint={"model": "other", "layers": 2})
    # another geometry: the payload's own checks name the field
    other = make_cache("reference", config(layers=3))
    with pytest.raises(InvalidArgumentError, match="num_layers|layers"):
        other.load_sequences(path)
    assert other.num_sequences == 0
    # another version of the format
    raw = path.read_bytes().replace(b'\\"version\\":1,\\"fingerprint', b'\\"version\\":7,\\"fingerprint')
    (tmp_path / "v7.kv").write_bytes(raw)
    with pytest.raises(UnsupportedFeatureError, match="version=7"):
        dst.load_sequences(tmp_path / "v7.kv")
    # room for some of the sequences only: the ones loaded first go again
    pages = [-(-e["payload"]["num_tokens"] // 4) for e in read_header(path)["sequences"]]
    assert pages[0] < sum(pages) - 2
    small = make_cache("reference", config(max_total_tokens=4 * (sum(pages) - 2)))
    with pytest.raises(CacheFullError):
        small.load_sequences(path)
    assert small.num_sequences == 0 and small.num_available_pages == small.num_total_pages
    assert snapshot(dst) == before


def test_bad_arguments_are_refused_before_writing(tmp_path):
    src, ids, _, _ = _saved(tmp_path, count=2)
    path = tmp_path / "x.kv"
    with pytest.raises(InvalidArgumentError, match="token ids list"):
        src.save_sequences(path, ids[:1], tokens=[[1, 2, 3]])
    with pytest.raises(InvalidArgumentError, match="2\\*\\*31"):
        src.save_sequences(path, ids[:1], tokens=[[-1] * src.sequence_length(ids[0])])
    with pytest.raises(kvcache.SequenceNotFoundError):
        src.save_sequences(path, [12345])
    assert not path.exists()


def test_the_files_bench_runs_and_judges_its_ratios(capsys):
    """``kvcache bench --files`` (1 MiB here): save and load against a plain write and read of
    the same bytes, in one run, each with its ratio and target."""
    from kvcache.cli import main
    assert main(["bench", "--files", "--files-mib", "1"]) == 0
    out = capsys.readouterr().out
    assert "save_sequences" in out and "load_sequences" in out and "loaded length right: True" in out
    assert "renamed over the old as save_sequences does" in out
    assert out.count("(target >= 0.8)") == 2
    assert main(["bench", "--files", "--files-mib", "1", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["tokens"] == 8 and res["save_over_write"] > 0 and res["load_over_read"] > 0
    assert res["replace_s"] > 0 and res["save_over_replace"] > 0


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3"])
def test_a_flipped_scale_in_a_quantized_file_is_refused_by_its_page(tmp_path, kv_dtype):
    """A file written from a quantized cache carries its scales: int8 in each packed row of K
    and V (after the row's codes), fp8 in the payload header (per layer, K's and V's per KV
    head). One flipped byte of a scale is refused by the page hash that covers it: int8 by
    the page of the row's token, fp8 by page 0, whose chain starts from the payload header;
    the cache is unchanged (no sequence, no page taken, no scales adopted)."""
    cfg = config(dtype="bfloat16", kv_dtype=kv_dtype)
    src = make_cache("reference", cfg)
    src.add_sequence(1)
    run_forward(src, [1], [11], np.random.default_rng(7))
    path = tmp_path / f"{kv_dtype}.kv"
    src.save_sequences(path, [1])
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    table = json.loads(raw[8:8 + n])
    entry = json.loads(table["__metadata__"]["kvcache"])["sequences"][0]
    if kv_dtype == "int8":
        _, tokens, heads, row = table[entry["k"]]["shape"]
        token, page = 6, 1                          # token 6 of layer 0, head 0: page 1 of 4
        at = 8 + n + table[entry["k"]]["data_offsets"][0] + (token * heads) * row
        at += cfg.head_dim + 1                      # the high byte of the row's first scale
    else:
        assert entry["payload"]["kv_scales"][0] is not None
        at = raw.index(b'kv_scales\\":[[[', 8) + len(b'kv_scales\\":[[[')
        while chr(raw[at + 1]) not in ",]":         # the last digit of layer 0's first scale
            at += 1
        assert chr(raw[at]).isdigit()
        page = 0
    raw[at] ^= 0x01
    bad = tmp_path / "bad.kv"
    bad.write_bytes(bytes(raw))
    dst = make_cache("reference", cfg)
    before = (snapshot(dst), [dst.kv_scales(x) for x in range(cfg.num_layers)])
    with pytest.raises(InvalidArgumentError,
                       match=rf"page {page} \(tokens {4 * page}\.\.\) fails its hash.*nothing was "
                             rf"loaded"):
        dst.load_sequences(bad)
    assert (snapshot(dst), [dst.kv_scales(x) for x in range(cfg.num_layers)]) == before
    assert dst.load_sequences(path) == [0]          # the file as written loads
    assert_same_kv(src, 1, dst, 0)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_large_files_move_in_chunks_checked_the_same(tmp_path, monkeypatch, kv_dtype):
    """The path of a large file, on small ones: chunks of one page (``_CHUNK_BYTES``), hashed
    and CRC'd on the hashing threads, written and read ahead on the io thread. The file is the
    one written in one piece, byte for byte; it loads bit for bit; a byte flipped in its last
    page is refused naming that page, the pages reserved for it given back; a load that
    converts the dtype (read whole, then imported) checks the same."""
    from kvcache import files
    kw = {} if kv_dtype == "auto" else {"kv_dtype": kv_dtype}
    src = make_cache("reference", config(dtype="bfloat16", prefix_cache=True, **kw))
    rng = np.random.default_rng(9)
    work = build_workload(src, rng, count=4, windows=False)
    tokens = [rng.integers(1, 500, src.sequence_length(s)).tolist() for s in work.ids]
    whole = tmp_path / "whole.kv"
    src.save_sequences(whole, work.ids, tokens=tokens)
    monkeypatch.setattr(files, "_CHUNK_BYTES", 1)          # one page a chunk
    monkeypatch.setattr(files, "_INLINE_BYTES", 0)         # every chunk on the threads
    path = tmp_path / "chunked.kv"
    src.save_sequences(path, work.ids, tokens=tokens)
    assert path.read_bytes() == whole.read_bytes()
    dst = make_cache("reference", config(page_size=3, dtype="bfloat16", prefix_cache=True, **kw))
    new = dst.load_sequences(path)
    for sid, did in zip(work.ids, new):
        assert_same_kv(src, sid, dst, did)
    # a byte of V in the last sequence's last token: its last page
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    table = json.loads(raw[8:8 + n])
    entry = json.loads(table["__metadata__"]["kvcache"])["sequences"][-1]
    lo, hi = table[entry["v"]]["data_offsets"]
    raw[8 + n + hi - 2] ^= 0x10
    bad = tmp_path / "bad.kv"
    bad.write_bytes(bytes(raw))
    last = len(entry["pages"]) - 1
    before = snapshot(dst)
    with pytest.raises(InvalidArgumentError, match=rf"sequence {len(work.ids) - 1}: page {last} "
                                                   rf"\(tokens {4 * last}\.\.\) fails its hash"):
        dst.load_sequences(bad)
    assert snapshot(dst) == before
    if kv_dtype == "auto":                  # into float32: converted, read whole
        wide = make_cache("reference", config(dtype="float32"))
        with pytest.raises(InvalidArgumentError, match=rf"page {last} .* fails its hash"):
            wide.load_sequences(bad, convert_dtype=True)
        assert wide.is_empty and wide.num_available_pages == wide.num_total_pages
        assert len(wide.load_sequences(path, convert_dtype=True)) == len(work.ids)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_into_reused_buffers_is_export_sequence(dtype):
    """The save's gather into reused buffers (``export_sequence_into``, the reference
    backend's ``gather_kv_into``) writes what ``export_sequence`` returns, over every kind of
    range: whole pages in one run, pages scattered by forks and windows, a partial last page,
    a start inside a page, an empty range. Quantized formats have no such path (None: the
    save exports them as before) and leave the buffers alone."""
    src = make_cache("reference", config(dtype=dtype))
    rng = np.random.default_rng(5)
    work = build_workload(src, rng, count=10, windows=True)
    ps = src.config.page_size
    src.add_sequence(1)
    src.add_sequence(2)
    for _ in range(3):                  # pages of 1 and 2 taken in turn: neither's in one run
        run_forward(src, [1, 2], [ps, ps + 1], rng)
    for sid in work.ids + [1, 2]:
        n = src.sequence_length(sid)
        for start, end in {(0, n), (0, n // ps * ps), (min(ps, n), n), (min(1, n), n), (n, n)}:
            want = src.export_sequence(sid, start, end)
            shape = (2, src.config.num_layers, end - start) + tuple(want.k.shape[2:])
            buf = np.full(shape, 7, want.k.dtype)
            got = src.payloads.export_sequence_into(sid, start, end, buf[0], buf[1])
            assert got is not None and got.header() == want.header()
            np.testing.assert_array_equal(buf[0], want.k)
            np.testing.assert_array_equal(buf[1], want.v)
    q = make_cache("reference", config(dtype="bfloat16", kv_dtype="int8"))
    q.add_sequence(1)
    run_forward(q, [1], [9], rng)
    k = np.zeros((q.config.num_layers, 9, q.config.num_kv_heads, q.config.head_dim),
                 src.export_sequence(work.ids[0]).k.dtype)
    assert q.payloads.export_sequence_into(1, 0, 9, k, k.copy()) is None
    assert not k.any()


def test_a_file_of_one_chunk_on_the_threads_loads(tmp_path, monkeypatch):
    """A sequence of one chunk that is not small (``_INLINE_BYTES``: hashed on the threads)
    has one read buffer: it is read into it, hashed and loaded (it was never read: a KeyError,
    for K of 2 to 32 MiB)."""
    from kvcache import files
    monkeypatch.setattr(files, "_INLINE_BYTES", 0)
    src = make_cache("reference", config(dtype="bfloat16"))
    src.add_sequence(1)
    run_forward(src, [1], [13], np.random.default_rng(2))
    path = tmp_path / "one-chunk.kv"
    src.save_sequences(path, [1], tokens=[list(range(13))])
    dst = make_cache("reference", config(dtype="bfloat16"))
    (did,) = dst.load_sequences(path)
    assert_same_kv(src, 1, dst, did)


def test_the_hashing_threads_follow_the_cores_and_files_do_not_change_with_them(
        tmp_path, monkeypatch):
    """Issue 57: the hashing threads are one per core the process may run on (its affinity),
    at most ``_MAX_WORKERS``; the page hashes and the CRC-32 (taken in a few tasks a chunk,
    combined in file order) give the same file, byte for byte, on 1 thread and on 7, for a
    KV file and a prefix cache file, and each loads on the other count."""
    import os

    from kvcache import files
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert files._hash_threads() == max(1, min(files._MAX_WORKERS, cores or 1))
    monkeypatch.setattr(files, "_CHUNK_BYTES", 1)          # one page a chunk
    monkeypatch.setattr(files, "_INLINE_BYTES", 0)         # every chunk on the threads
    src = make_cache("reference", config(dtype="bfloat16", prefix_cache=True))
    rng = np.random.default_rng(11)
    work = build_workload(src, rng, count=4, windows=False)
    tokens = [rng.integers(1, 500, src.sequence_length(s)).tolist() for s in work.ids]
    system = rng.integers(1, 500, 9).tolist()
    for sid in (20, 21):                    # the prefix cache: two chats under one prompt
        chat = system + rng.integers(1, 500, 6 + sid % 2 * 5).tolist()
        start = src.add_sequence(sid, chat)
        run_forward(src, [sid], [len(chat) - start], rng)
        src.remove_sequence(sid)
    out: dict = {}
    for threads in (1, 7):
        monkeypatch.setattr(files, "_WORKERS", threads)
        assert files._pool()._max_workers == threads       # (the pool follows the count)
        out[threads] = (tmp_path / f"seqs{threads}.kv", tmp_path / f"prefix{threads}.kv")
        src.save_sequences(out[threads][0], work.ids, tokens=tokens)
        src.save_prefix_cache(out[threads][1])
    for a, b in zip(out[1], out[7]):
        assert a.read_bytes() == b.read_bytes()
    for threads in (7, 1):                  # each loads with the other count of threads
        monkeypatch.setattr(files, "_WORKERS", threads)
        dst = make_cache("reference", config(dtype="bfloat16", prefix_cache=True))
        new = dst.load_sequences(out[8 - threads][0])
        for sid, did in zip(work.ids, new):
            assert_same_kv(src, sid, dst, did)
        fresh = make_cache("reference", config(dtype="bfloat16", prefix_cache=True))
        assert fresh.load_prefix_cache(out[8 - threads][1]) == src.num_cached_pages == 3 + 3
