"""Verified moves (issue 57): the host tier's ``restore`` and ``recv_sequence`` check the SHA-256
hash chain over pages that KV files carry (``kvcache.files``: rooted at the payload header,
over each page's token ids, K and V), so a byte changed between the offload (or the send) and
the use is refused with a typed error naming the sequence and the page, and nothing changes.

For each format (bfloat16; fp8, whose scales are in the payload header; int8, whose scales are
in its packed rows) one byte is flipped in K, in V, in a scale, in a token id and in the
header, in a parked payload and in a transfer; the transfer's flips are made after the JSON's
CRC-32 and the data's sums were taken (which catch a flip on the wire already), so only the
chain can refuse them. The transfer runs on two gloo ranks (this file is also their worker:
``python test_verified_moves.py RANK INIT_FILE``)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvcache
from kvcache import HostTier
from transfer_cases import assert_same_kv, config, make_cache, run_forward, snapshot

try:
    import torch
    import torch.distributed as dist
except ImportError:                     # the transfer test is skipped then
    torch = dist = None

HERE = Path(__file__).resolve().parent
FORMATS = ["auto", "float8_e4m3", "int8"]
PARTS = ["K", "V", "scale", "token id", "header"]
PAGE = {"K": 1, "V": 2, "scale": None, "token id": 1, "header": 0}
"""The page (of 4 tokens) each flip lands in: K at token 6, V at token 9, a token id at 7; a
header field roots the chain, so page 0; a scale: page 0 for fp8 (in the header), 1 for int8
(in token 5's packed row)."""


def _cache(kv_dtype: str, page_size: int = 4, backend: str = "reference"):
    kw = {} if kv_dtype == "auto" else {"kv_dtype": kv_dtype}
    return make_cache(backend, config(page_size, "bfloat16", "normal", prefix_cache=True, **kw))


def _flip_float(x: float) -> float:
    """``x`` with one bit of its float32 mantissa flipped (a byte of a scale changed)."""
    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    return struct.unpack("<f", struct.pack("<I", bits ^ 0x10))[0]


def _byte_of(a: np.ndarray, token: int, at: int) -> tuple:
    """The index, in ``a.view(np.uint8)`` (shape (layers, tokens, heads, bytes)), of byte
    ``at`` of ``token``'s row in layer 0, head 0."""
    return (0, token, 0, at)


def _scale_byte(cfg) -> int:
    """The byte of an int8 packed row that holds (the high byte of) its first scale: after
    the ``head_dim`` codes (kv_quant.affine_pack)."""
    return cfg.head_dim + 1


def _states(cache) -> tuple:
    """What a refused restore or receive must leave as it was: ``snapshot``, the fp8 scales
    and the prefix index's view of the test's ids."""
    return (snapshot(cache), [cache.kv_scales(x) for x in range(cache.config.num_layers)],
            cache.match_prefix(IDS + [1]))


IDS = [(7 * i + 3) % 500 for i in range(11)]
"""The token ids of the host tier's sequence (11 tokens: pages of 4, 4, 3)."""


# ----------------------------------------------------------------------------- the host tier

@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_a_flipped_byte_in_a_parked_sequence_is_refused_and_nothing_changes(kv_dtype, part):
    if part == "scale" and kv_dtype == "auto":
        pytest.skip("bfloat16 pages carry no scales")
    cache, twin = _cache(kv_dtype), _cache(kv_dtype)
    cache.add_sequence(1)
    run_forward(cache, [1], [len(IDS)], np.random.default_rng(3))
    twin.import_sequence(1, cache.export_sequence(1))
    tier = HostTier(cache, verify=True)
    assert tier.verify and tier.offload(1, tokens=IDS) == len(IDS)
    payload = tier.parked(1)
    before, held = _states(cache), tier.tokens
    page = PAGE[part]
    if part == "K":
        undo = _flip(payload.k.view(np.uint8), _byte_of(payload.k, 6, 3), 0x40)
    elif part == "V":
        undo = _flip(payload.v.view(np.uint8), _byte_of(payload.v, 9, 1), 0x04)
    elif part == "token id":
        undo = _flip(tier.parked_tokens(1).view(np.uint8), 4 * 7, 0x01)
    elif part == "scale" and kv_dtype == "int8":
        page = 1
        undo = _flip(payload.k.view(np.uint8), _byte_of(payload.k, 5, _scale_byte(cache.config)),
                     0x01)
    else:   # a header field, or fp8's scales (in the header): the chain's root
        page = 0
        name = "kv_scales" if part == "scale" else "source_length"
        old = getattr(payload, name)
        if part == "scale":
            (k0, v0), *rest = old
            new = ((k0, (_flip_float(v0[0]),) + tuple(v0[1:])), *rest)
        else:
            new = old ^ (1 << 10)
        object.__setattr__(payload, name, new)          # the tier's copy, changed in place

        def undo():
            object.__setattr__(payload, name, old)
    with pytest.raises(kvcache.KVCacheError) as info:
        tier.restore(1)
    assert f"page {page} (tokens {4 * page}..) fails its hash" in str(info.value), info.value
    assert "sequence 1" in str(info.value) and "stays parked" in str(info.value)
    # nothing changed: the cache (sequences, pages, K/V, scales, prefix index), the tier
    assert _states(cache) == before and 1 in tier and tier.tokens == held
    undo()                                              # put back: restored bit for bit
    assert tier.restore(1) == len(IDS) and 1 not in tier
    assert_same_kv(twin, 1, cache, 1)
    assert cache.match_prefix(IDS + [1]) == 8          # its ids recorded: 2 full pages cached


def _flip(bits: np.ndarray, at, mask: int):
    """Flip ``mask`` in ``bits[at]`` (in place); returns the call that flips it back."""
    bits[at] ^= mask

    def undo():
        bits[at] ^= mask
    return undo


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_the_chain_is_checked_before_the_upload_on_every_backend(backend):
    """The chain refuses a flipped K byte before ``from_host`` (the device checksums, which
    would refuse it after the upload, never run), on the reference backend and cuda's CPU
    test mode."""
    cache = _cache("auto", backend=backend)
    cache.add_sequence(1)
    run_forward(cache, [1], [len(IDS)], np.random.default_rng(4))
    tier = HostTier(cache, verify=True)
    tier.offload(1)
    uploads = []
    real = cache.backend.from_host
    cache.backend.from_host = lambda host: uploads.append(host) or real(host)
    bits = tier.parked(1).k.view(np.uint8)
    bits[0, 10, 1, 5] ^= 0x08                           # token 10: page 2
    with pytest.raises(kvcache.KVCacheError, match=r"page 2 \(tokens 8\.\.\) fails its hash"):
        tier.restore(1)
    assert uploads == [] and cache.is_empty and 1 in tier


def test_verify_false_parks_no_chain_and_keeps_the_device_checksums():
    """The opt-out: ``HostTier(cache, verify=False)`` hashes nothing; a flipped K byte is
    still refused, by the device checksums after the upload."""
    cache = _cache("auto")
    cache.add_sequence(1)
    run_forward(cache, [1], [len(IDS)], np.random.default_rng(5))
    tier = HostTier(cache, verify=False)
    tier.offload(1, tokens=IDS)
    assert tier._held[1].pages is None
    bits = tier.parked(1).k.view(np.uint8)
    bits[0, 2, 0, 0] ^= 0x01
    with pytest.raises(kvcache.KVCacheError, match="checksums"):
        tier.restore(1)
    bits[0, 2, 0, 0] ^= 0x01
    assert tier.restore(1) == len(IDS)
    with pytest.raises(kvcache.InvalidArgumentError, match="verify"):
        HostTier(cache, verify="yes")


def test_offload_refuses_token_ids_that_do_not_fit_and_changes_nothing():
    cache = _cache("auto")
    cache.add_sequence(1)
    run_forward(cache, [1], [len(IDS)], np.random.default_rng(6))
    tier = HostTier(cache, verify=True)
    before = snapshot(cache)
    with pytest.raises(kvcache.InvalidArgumentError,
                       match="sequence 1 holds 11 tokens, its token ids list 10"):
        tier.offload(1, tokens=IDS[:10])
    with pytest.raises(kvcache.InvalidArgumentError, match=r"token id -1 must lie in \[0, 2\*\*31\)"):
        tier.offload(1, tokens=[-1] * len(IDS))
    assert snapshot(cache) == before and len(tier) == 0


# ----------------------------------------------------------------------------- transfers

TOKENS = [(11 * i + 5) % 700 for i in range(13)]
"""The sent sequence's token ids (13 tokens: sender pages of 4, 4, 4, 1)."""


@pytest.mark.skipif(dist is None or not dist.is_available() or not dist.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_a_transfer_with_a_flipped_byte_anywhere_is_refused_and_nothing_changes(tmp_path):
    env = dict(os.environ, KVCACHE_CUDA_CPU="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    init = tmp_path / "rendezvous"
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(rank),
                               str(init)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    log = "\n".join(f"--- rank {r} (exit {p.returncode})\n{o}"
                    for r, (p, o) in enumerate(zip(procs, outs)))
    assert all(p.returncode == 0 for p in procs), log
    for kv_dtype in FORMATS:
        assert f"{kv_dtype}: sent with its ids, hashed, bit for bit, ids recorded" in outs[1], log
        parts = [p for p in PARTS if not (p == "scale" and kv_dtype == "auto")]
        assert f"{kv_dtype}: refused {parts}, nothing changed; in step after" in outs[1], log
    assert "sent during its forward with its ids: hashed, bit for bit" in outs[1], log


def _raw_send(src, ids: list, part: str, dst: int) -> None:
    """Sequence 1 of ``src`` sent by hand in the wire's layout (one layer a message), its hash
    chain taken from the bytes as they should be; then one byte of ``part`` changed, after
    which the JSON's CRC-32 and the messages' sums are taken, so that they agree with the
    change: only the chain can see it."""
    from kvcache.config import itemsize
    from kvcache.distributed.endpoints import _sums
    from kvcache.distributed.send import _tail
    from kvcache.distributed.wire import chain_pages, head_message, transfer_chains
    c = src.config
    headers, k, v = src.export_sequences([1])
    dtype = c.kv_format.payload_dtype(c.dtype)
    msg = {"version": 1, "kv_dtype": c.kv_dtype, "dtype": dtype, "shape": list(k.shape),
           "nbytes": k.nbytes, "payloads": [h.header() for h in headers], "tokens": [list(ids)],
           "page_size": c.page_size}
    layers = k.shape[0]
    spans = [range(x, x + 1) for x in range(layers)]
    messages = [np.concatenate([np.ascontiguousarray(a[x]).reshape(-1).view(np.uint8)
                                for a in (k, v)]) for x in range(layers)]
    good = json.loads(json.dumps(msg))
    chain = transfer_chains(good["payloads"], good["tokens"], c.page_size, spans, messages,
                            tuple(k.shape), itemsize(dtype))
    words = np.frombuffer(b"".join(d for d in chain[0]), "<i8").copy()
    row = k.nbytes // (k.shape[0] * k.shape[1])             # one token's bytes in a layer
    half = messages[0].size // 2
    if part == "K":
        messages[0][6 * row + 3] ^= 0x40
    elif part == "V":
        messages[-1][half + 9 * row + 1] ^= 0x04
    elif part == "scale" and c.kv_dtype == "int8":
        messages[0][5 * row + _scale_byte(c)] ^= 0x01     # token 5's row, head 0
    elif part == "scale":
        scales = msg["payloads"][0]["kv_scales"]
        scales[0][1][0] = _flip_float(scales[0][1][0])
    elif part == "token id":
        msg["tokens"][0][7] ^= 1
    elif part == "header":
        msg["payloads"][0]["source_length"] ^= 1 << 10
    body = json.dumps(msg).encode()
    head, rest = head_message(body, k.nbytes, layers, 1, False, chain_pages(headers, c.page_size))
    dist.send(torch.from_numpy(head), dst)
    if rest:
        dist.send(torch.frombuffer(bytearray(rest), dtype=torch.uint8), dst)
    sums = []
    for m in messages:
        t = torch.from_numpy(m)
        sums.append(_sums(torch, t))
        dist.send(t, dst)
    dist.send(_tail(torch, True, sums, torch.device("cpu"), words), dst)


def _transfers(rank: int, kv_dtype: str) -> None:
    from kvcache.distributed import recv_sequence, send_sequence
    src = _cache(kv_dtype)
    src.add_sequence(1)
    run_forward(src, [1], [len(TOKENS)], np.random.default_rng(11))
    parts = [p for p in PARTS if not (p == "scale" and kv_dtype == "auto")]
    if rank == 0:
        send_sequence(src, [1], dst=1, tokens=[TOKENS]).wait()
        for part in parts:
            _raw_send(src, TOKENS, part, 1)
        send_sequence(src, [1], dst=1, tokens=[TOKENS]).wait()
        return
    dest = _cache(kv_dtype, page_size=3)                # another page size: the chain is the sender's
    assert recv_sequence(dest, [5], src=0).wait() == [5]
    assert_same_kv(src, 1, dest, 5)
    assert dest.match_prefix(TOKENS + [1]) == 12        # its ids recorded: 4 full pages of 3
    print(f"{kv_dtype}: sent with its ids, hashed, bit for bit, ids recorded", flush=True)
    # a cache that has no fp8 scales yet (a changed scale would otherwise meet the check of
    # the scales against the cache's first), and no ids
    dest = _cache(kv_dtype, page_size=3)
    before = (snapshot(dest), [dest.kv_scales(x) for x in range(dest.config.num_layers)],
              dest.match_prefix(TOKENS + [1]))
    for part in parts:
        page = PAGE[part] if PAGE[part] is not None else (1 if kv_dtype == "int8" else 0)
        h = recv_sequence(dest, [6], src=0)
        try:
            h.wait()
        except kvcache.KVCacheError as exc:
            want = f"sequence 6's page {page} (its tokens from {4 * page}) fails its hash"
            assert want in str(exc) and "nothing was kept" in str(exc), (part, exc)
        else:
            raise AssertionError(f"a transfer with a changed {part} was kept")
        after = (snapshot(dest), [dest.kv_scales(x) for x in range(dest.config.num_layers)],
                 dest.match_prefix(TOKENS + [1]))
        assert after == before, part
    assert recv_sequence(dest, [7], src=0).wait() == [7]
    assert_same_kv(src, 1, dest, 7)
    print(f"{kv_dtype}: refused {parts}, nothing changed; in step after", flush=True)


def _streamed(rank: int) -> None:
    """A send from inside the forward that writes the tokens carries the chain of the
    sequence after it, and its ids."""
    from kvcache.distributed import recv_sequence, send_sequence
    src = _cache("auto")
    rng = np.random.default_rng(12)
    src.add_sequence(1)
    run_forward(src, [1], [9], rng)
    if rank == 0:
        c = src.config
        src.begin_forward([1], [4])
        h = send_sequence(src, [1], dst=1, tokens=[TOKENS])
        for layer in range(c.num_layers):
            x = [src.from_numpy(rng.standard_normal((4, n, c.head_dim)).astype(np.float32))
                 for n in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads)]
            src.attention(layer, *x)
        src.end_forward()
        h.wait()
        send_sequence(src, [1], dst=1).wait()
        return
    dest = _cache("auto")
    assert recv_sequence(dest, [5], src=0).wait() == [5]
    assert recv_sequence(dest, [6], src=0).wait() == [6]
    assert_same_kv(dest, 6, dest, 5)
    assert dest.match_prefix(TOKENS + [1]) == 12
    print("sent during its forward with its ids: hashed, bit for bit", flush=True)


def _worker(rank: int, init: str) -> None:
    os.environ["KVCACHE_CUDA_CPU"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        for kv_dtype in FORMATS:
            _transfers(rank, kv_dtype)
        _streamed(rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2])
