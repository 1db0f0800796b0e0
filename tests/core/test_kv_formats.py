"""One KVFormat table (issue 52 item 2): ``kvcache.formats.FORMAT_TABLE`` is the one list of the
storage formats; the config, the payloads and the reference backend ask a format what it is
instead of testing names, so a format added to the table (and to kv_quant and the kernels)
works without touching them."""

import dataclasses

import numpy as np
import pytest

from kvcache import CacheConfig, InvalidArgumentError, PagedKVCache
from kvcache import config as config_mod
from kvcache import formats, kv_quant
from kvcache.formats import FORMAT_TABLE, KVFormat, kv_format
from kvcache.reference import ReferenceBackend


def config(**kw):
    base = dict(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=4,
                max_total_tokens=64, dtype="bfloat16", rope_mode="none")
    return CacheConfig(**{**base, **kw})


def test_the_table_is_the_one_list_of_names():
    assert config_mod.DTYPES == tuple(n for n, f in FORMAT_TABLE.items() if not f.quantized)
    assert config_mod.KV_FORMATS == tuple(n for n, f in FORMAT_TABLE.items() if f.quantized)
    assert kv_quant.AFFINE_BITS == {n: f.bits for n, f in FORMAT_TABLE.items() if f.packed}
    # the reference declares every format of the table (fp8 / bfloat16 need ml_dtypes)
    assert set(ReferenceBackend.capabilities.kv_dtypes) <= set(FORMAT_TABLE)
    # CacheConfig accepts exactly the table's names (a plain dtype: only the compute one)
    for name, fmt in FORMAT_TABLE.items():
        dtype = name if not fmt.quantized else "bfloat16"
        c = config(dtype=dtype, kv_dtype=name)
        assert c.kv_format is fmt and c.kv_quantized == fmt.quantized
    with pytest.raises(InvalidArgumentError, match="float8"):
        config(kv_dtype="float8")


def test_kv_format_lookup_names_the_formats():
    assert kv_format("int4").packed and kv_format("float8_e4m3").scaled
    for bad in ("int2", None, 8):
        with pytest.raises(InvalidArgumentError, match="int4"):
            kv_format(bad)


@pytest.mark.parametrize("name", list(FORMAT_TABLE))
def test_each_format_says_what_it_is(name):
    fmt = FORMAT_TABLE[name]
    assert fmt.quantized == (fmt.scaled or fmt.packed) and not (fmt.scaled and fmt.packed)
    assert fmt.payload_dtype("float16") == ("uint8" if fmt.packed else "float16" if fmt.scaled
                                            else name)
    assert (fmt.storage == "uint8") == fmt.packed


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name", list(FORMAT_TABLE))
def test_row_bytes_are_what_the_config_counts(name, dtype, group):
    fmt = FORMAT_TABLE[name]
    if not fmt.quantized and name != dtype:
        pytest.skip("a plain format is only the compute dtype")
    c = config(dtype=dtype, kv_dtype=name, kv_quant_group=group, head_dim=128)
    row = fmt.row_bytes(c.page_row_dim, dtype, group)
    assert c.token_kv_bytes == c.num_layers * 2 * c.num_kv_heads * row
    if fmt.packed:       # the bytes of the rows kv_quant packs
        x = np.random.default_rng(0).standard_normal((3, 2, 128)).astype(np.float32)
        codes, s, b = kv_quant.affine_quantize(x, fmt.bits, group, dtype)
        assert kv_quant.affine_pack(codes, s, b, fmt.bits).shape[-1] == row
    else:       # fp8: a byte a value (its scales are outside the pages); plain: the dtype's
        assert row == 128 * (1 if fmt.scaled else config_mod.itemsize(name))


@pytest.fixture
def int4_test(monkeypatch):
    """A test-only affine format, registered in the table and declared by the reference (its
    kernels store any packed format of the table: kv_quant's rule with the format's bits)."""
    fmt = KVFormat("int4_test", "uint8", 4, packed=True)
    monkeypatch.setitem(formats.FORMAT_TABLE, fmt.name, fmt)
    caps = ReferenceBackend.capabilities
    monkeypatch.setattr(ReferenceBackend, "capabilities",
                        dataclasses.replace(caps, kv_dtypes=caps.kv_dtypes + (fmt.name,)))
    return fmt


def test_a_format_added_to_the_table_goes_through_the_generic_path(int4_test):
    c = config(kv_dtype="int4_test", kv_quant_group=32)
    assert c.kv_format is int4_test and c.kv_quantized
    assert c.token_kv_bytes == config(kv_dtype="int4", kv_quant_group=32).token_kv_bytes
    with pytest.raises(InvalidArgumentError, match="head_dim=96"):
        config(kv_dtype="int4_test", head_dim=96)      # the group check asks .packed
    rng = np.random.default_rng(1)
    k = rng.standard_normal((5, 2, 64)).astype(np.float32)
    v = rng.standard_normal((5, 2, 64)).astype(np.float32)
    q = rng.standard_normal((5, 4, 64)).astype(np.float32)
    got = {}
    for name in ("int4", "int4_test"):
        cache = PagedKVCache(config(kv_dtype=name, kv_quant_group=32, dtype="float32"),
                             backend="reference")
        cache.add_sequence(0)
        with cache.forward([0], [5]):
            outs = [cache.attention(layer, q, k, v) for layer in range(2)]
        kb, vb = cache.get_kv(0, layer=1)
        got[name] = [np.asarray(x, np.float32) for x in (kb, vb, *outs)]
    for a, b in zip(got["int4"], got["int4_test"]):
        np.testing.assert_array_equal(a, b)
    # what it read back is kv_quant's rule with the table's bits, not the values given
    want = kv_quant.roundtrip(k, "int4_test", "float32", 32)
    assert not np.array_equal(got["int4_test"][0], k)
    np.testing.assert_array_equal(got["int4_test"][0], want)


def test_a_format_added_to_the_table_moves_between_caches(int4_test):
    # payloads and their checks ask the table as it is, not a list fixed at import: a table-only
    # format exports as packed rows, crosses the host as a payload and imports bit for bit
    from kvcache import to_numpy
    rng = np.random.default_rng(2)
    c = config(kv_dtype="int4_test", kv_quant_group=32, dtype="float32")
    src = PagedKVCache(c, backend="reference")
    src.add_sequence(0)
    with src.forward([0], [6]):
        for layer in range(2):
            src.attention(layer, *(rng.standard_normal((6, h, 64)).astype(np.float32)
                                   for h in (4, 2, 2)))
    payload = src.export_sequence(0).to_numpy()
    assert payload.kv_dtype == "int4_test" and payload.k.dtype == np.uint8
    dst = PagedKVCache(c, backend="reference")
    dst.import_sequence(3, payload)
    again = dst.export_sequence(3)
    np.testing.assert_array_equal(to_numpy(again.k), payload.k)
    for layer in range(2):
        for a, b in zip(src.get_kv(0, layer=layer), dst.get_kv(3, layer=layer)):
            np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
    # the wire's header check takes it too (the JSON a transfer's sender writes)
    import json
    from kvcache.distributed import wire
    headers, k, v = src.export_sequences([0])
    shape = [2, 6, 2, k.shape[-1]]
    nbytes = int(np.prod(shape))
    body = json.dumps({"version": 1, "kv_dtype": "int4_test", "dtype": "uint8", "shape": shape,
                       "nbytes": nbytes, "payloads": [h.header() for h in headers]}).encode()
    msg, got_shape, got = wire._read_header(body, nbytes, [0], 1)
    assert msg["kv_dtype"] == "int4_test" and list(got_shape) == shape
    assert got[0].kv_dtype == "int4_test"
