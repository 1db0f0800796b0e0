"""Importing a payload that is not what its header says: a payload crosses a process or machine
boundary (``export_sequence(...).to_numpy()``, pickled, sent), so ``import_sequence`` and
``reserve_import`` check it against its header (dtype, shape, byte size, checksum, field
types) and refuse it whole, typed, with nothing changed: no sequence, no page taken, the
other sequences' K/V as they were."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from .base import Conformance


def _bad_arrays(payload):
    """(label, k) pairs: K arrays that are not what a float header says."""
    k = payload.k
    return [
        ("bool", k > 0),
        ("int32", k.astype(np.int32)),
        ("uint32 bits", np.ascontiguousarray(k).view(np.uint32) if k.dtype.itemsize == 4
         else k.astype(np.uint32)),
        ("float64", k.astype(np.float64)),
        ("complex", k.astype(np.complex64)),
        ("strings", k.astype(np.float32).astype(str)),    # (ml_dtypes bfloat16 has no str cast)
        ("objects", np.full(k.shape, None, dtype=object)),
        ("a list", k.tolist()),
        ("None", None),
        ("too few tokens", k[:, :-1]),
        ("one layer", k[:1]),
    ]


class TestPayloadImport(Conformance):
    """Malformed payloads: typed, atomic, on both the reference and the backend."""

    def _exported(self, p):
        """A host payload of sequence 0 (13 tokens, partial page), and a live sequence 1."""
        p.add(0, 1)
        p.forward([0, 1], [p.config.page_size + 5, 3])
        return p.ref.export_sequence(0).to_numpy()

    def test_arrays_that_are_not_the_header(self, make_pair):
        from kvcache import InvalidArgumentError
        p = make_pair()
        good = self._exported(p)
        for label, k in _bad_arrays(good):
            bad = dataclasses.replace(good, k=k, checksum=None)
            err = p.expect_error(InvalidArgumentError, "import_sequence", 7, bad)
            assert "sequence 7" in str(err) or "import" in str(err), (label, err)
            p.expect_error(InvalidArgumentError, "reserve_import", [(7, bad, None, None)])
        from kvcache.arrays import to_host
        for cache in (p.ref, p.dut):                # the genuine payload goes in, bit for bit
            cache.import_sequence(7, good)
            k, v = cache.get_kv(7)
            assert np.array_equal(to_host(k, good.kv_dtype), good.k)
            assert np.array_equal(to_host(v, good.kv_dtype), good.v)
            cache.remove_sequence(7)
        p.check()

    def test_checksum_and_header_fields(self, make_pair):
        from kvcache import InvalidArgumentError, SequencePayload
        p = make_pair()
        good = self._exported(p)
        flipped = good.k.copy()
        flipped.reshape(-1).view(np.uint8)[5] ^= 1        # one bit of one value
        cases = [
            ("a flipped bit", dataclasses.replace(good, k=flipped)),
            ("swapped K and V", dataclasses.replace(good, k=good.v, v=good.k)),
            ("kv_dtype None", dataclasses.replace(good, kv_dtype=None)),
            ("kv_dtype int8", dataclasses.replace(good, kv_dtype="int8")),
            ("rope_theta a string", dataclasses.replace(good, rope_theta="1e4")),
            ("rope_inv_freq None", dataclasses.replace(good, rope_inv_freq=None)),
            ("num_tokens a float", dataclasses.replace(good, num_tokens=13.0)),
        ]
        for label, bad in cases:
            p.expect_error(InvalidArgumentError, "import_sequence", 7, bad)
        header = good.header()
        for field, value in [("rope_inv_freq", None), ("rope_inv_freq", ["x"]),
                             ("head_dim", "64"), ("kv_dtype", "float64"), ("rope_mode", 3)]:
            with pytest.raises(InvalidArgumentError, match=field):
                SequencePayload.from_header({**header, field: value}, good.k, good.v)
        p.check()

    def test_malformed_items_and_foreign_reservations(self, make_pair):
        from kvcache import InvalidArgumentError
        p = make_pair()
        good = self._exported(p)
        for items in ([(9,)], [None], 5, "abc", [(7, good)]):
            p.expect_error(InvalidArgumentError, "reserve_import", items)
        for method in ("commit_import", "cancel_import"):
            p.expect_error(InvalidArgumentError, method, None)
        # a reservation belongs to its cache: the other refuses it and leaves it usable
        free = p.dut.num_available_pages
        res = p.dut.reserve_import([(7, good, None, None)])
        assert p.dut.num_available_pages < free
        for method in ("commit_import", "cancel_import"):
            with pytest.raises(InvalidArgumentError, match="another cache"):
                getattr(p.ref, method)(res)
        k, v = (p.dut.from_numpy(a) for a in (good.k, good.v))
        with pytest.raises(InvalidArgumentError, match="another cache"):
            p.ref.write_import(res, k, v)
        p.dut.cancel_import(res)
        assert p.dut.num_available_pages == free
        p.check()
