"""The prefix cache's files: ``cache.prefix_cache.save(path)`` / ``load(path)`` (also
``PagedKVCache.save_prefix_cache`` / ``load_prefix_cache``; the format: docs/kv-files.md).

A prefix cache file is a KV file (``kvcache.files``, the same container, header, page hashes
and checks) whose header says ``"contents": "prefix-cache"`` and whose entries are the chains
of the prefix index: the tokens of a cached prefix, whole pages, with their ids (a prefix
cache finds pages by them), their extra key, and where a chain continues an earlier one
(prefixes that share pages, a system prompt under many conversations, write those pages
once): ``"parent": [index, that entry's page hash at the join]``. Saving writes it as
``save_sequences`` writes a KV file (``files.write_payloads`` with ``fetches``): a chunk of
pages at a time through a few reused buffers, hashed on the threads beside the writes.

Loading checks all of the file first (``files.read_payloads``: bounds, header, format and
version, fingerprint, every page hash, each payload's CRC-32 and fit, the parent links, then
the prefix cache's own fields and the room), then imports every chain as a sequence (a
continuing one as a fork of its parent's), records its ids (``KVManager.cache_imported``) and
removes it, so its pages stay in the index as cached pages: unreferenced, evictable, and
attached by a later ``add_sequence`` whose tokens begin with them, as if a request had
computed them here. A plain KV file of sequences with token ids loads too (each sequence a
chain from token 0; a partial last page is dropped).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

from . import files
from .core.imports import ImportSpec
from .core.imports import pages_needed as import_pages
from .errors import CacheFullError, InvalidArgumentError, UnsupportedFeatureError
from .transfer import SequencePayload, payload_fields

if TYPE_CHECKING:  # pragma: no cover
    from .cache import PagedKVCache

__all__ = ["CONTENTS", "PrefixCache", "save", "load"]

CONTENTS = "prefix-cache"
"""The ``contents`` field of a prefix cache file's header (a file of sequences has none)."""


class PrefixCache:
    """The prefix cache of one ``PagedKVCache`` (``cache.prefix_cache``), as the SPEC names
    it: ``save(path)`` and ``load(path)``. A view: it holds the cache and nothing else."""

    def __init__(self, cache: "PagedKVCache") -> None:
        self.cache = cache

    def save(self, path, fingerprint: Optional[dict] = None,
             prefixes: Optional[Sequence] = None, extra_key: Any = None) -> int:
        """``PagedKVCache.save_prefix_cache``: write the cached prefixes to ``path``."""
        return self.cache.save_prefix_cache(path, fingerprint, prefixes, extra_key)

    def load(self, path, fingerprint: Optional[dict] = None, convert_dtype: bool = False) -> int:
        """``PagedKVCache.load_prefix_cache``: put a file's prefixes in the cache as cached
        pages."""
        return self.cache.load_prefix_cache(path, fingerprint, convert_dtype)

    @property
    def num_cached_pages(self) -> int:
        """The cache's ``num_cached_pages``."""
        return self.cache.num_cached_pages

    def __repr__(self) -> str:
        return f"<prefix cache of {self.cache!r}>"


# ---------------------------------------------------------------------- extra keys in JSON
def _encode_extra(key, where: str):
    """An extra key as JSON: null, a string, number or bool as it is, a tuple as ``{"tuple":
    [...]}``; anything else cannot be written (InvalidArgumentError)."""
    if key is None or isinstance(key, (str, bool, int, float)):
        return key
    if isinstance(key, tuple):
        return {"tuple": [_encode_extra(k, where) for k in key]}
    raise InvalidArgumentError(
        f"{where}: extra key {key!r:.80} ({type(key).__name__}) cannot be written: a file holds "
        f"None, str, int, float, bool and tuples of them")


def _decode_extra(value, where: str):
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict) and set(value) == {"tuple"} and isinstance(value["tuple"], list):
        return tuple(_decode_extra(v, where) for v in value["tuple"])
    raise InvalidArgumentError(f"{where}: extra_key={value!r:.80} is not an encoded extra key")


# ---------------------------------------------------------------------- save
def save(cache: "PagedKVCache", path, fingerprint: Optional[dict] = None,
         prefixes: Optional[Sequence] = None, extra_key: Any = None) -> int:
    """Write the prefix cache of ``cache`` to the file ``path`` (replaced whole: written beside
    it, then renamed): every cached prefix (``prefixes`` None), or the longest cached prefix
    of each token id list in ``prefixes`` under ``extra_key`` (e.g. a conversation: its
    prompt and the tokens that followed), whole pages, each page once. ``fingerprint``: a
    JSON-able dict naming the model, compared by ``load``. Returns the pages written (0: an
    empty file, which loads as nothing). Changes nothing in the cache (not even the
    least-recently-used order). Raises InvalidArgumentError without the prefix cache, for
    bad ids, or for an extra key a file cannot hold (None, str, int, float, bool, tuples of
    them); UnsupportedFeatureError where payloads cannot carry the cache's K/V
    (``head_dim_v``); nothing is written then."""
    c = cache.config
    chains = cache.manager.prefix_chains(prefixes, extra_key)
    if c.head_dim_v != c.head_dim:
        raise UnsupportedFeatureError(
            f"saving the prefix cache: payloads carry K and V with one head dim, but this "
            f"cache has head_dim={c.head_dim} and head_dim_v={c.head_dim_v} (not supported yet)")
    entry_fields = [{"extra_key": _encode_extra(ch.extra, "saving the prefix cache")}
                    for ch in chains]
    pt, fields = cache.state.pt, payload_fields(c)
    scales = None if cache.scales is None else cache.scales.for_payload()
    payloads, tokens, fetches = [], [], []
    for ch in chains:
        # the holder's first ``end`` tokens are the chain's prefix: the chain's own pages
        # are its tokens ``start .. end - 1`` (a ghost has no id: read its slots directly)
        slots = pt.position_slots(pt.seqs[ch.holder], ch.start, ch.end)
        payloads.append(SequencePayload(None, None, start=ch.start, num_tokens=ch.end - ch.start,
                                        source_length=ch.end, kv_scales=scales, **fields))
        fetches.append(_rows(cache, slots))
        ids = memoryview(ch.ids).cast("q")
        tokens.append(list(ids[ch.start:ch.end]))
    # written a chunk at a time, as save_sequences writes (files._write_streamed)
    files.write_payloads(path, payloads, tokens, c.page_size, fingerprint,
                         parents=[ch.parent for ch in chains],
                         header_fields={"contents": CONTENTS}, entry_fields=entry_fields,
                         fetches=fetches)
    return sum((ch.end - ch.start) // c.page_size for ch in chains)


def _rows(cache: "PagedKVCache", slots):
    """``files.write_payloads``' fetch of the rows at ``slots``: tokens ``t0 .. t1-1`` of them
    as a payload carries them (``Payloads._stored_rows``), into the reused buffers where the
    backend can (``Backend.gather_kv_into``: formats that are not quantized)."""
    p = cache.payloads
    direct = not p.packed and p.scales is None

    def rows(t0: int, t1: int, k_out, v_out) -> tuple:
        if direct and cache.backend.gather_kv_into(p.pages, slots[t0:t1], k_out, v_out):
            return k_out, v_out
        return p._stored_rows(slots[t0:t1])
    return rows


# ---------------------------------------------------------------------- load
def load(cache: "PagedKVCache", path, fingerprint: Optional[dict] = None,
         convert_dtype: bool = False) -> int:
    """Put the prefixes of the file ``path`` into ``cache``'s prefix cache as cached pages
    (unreferenced, evictable): a later ``add_sequence`` whose tokens begin with one of them
    attaches its pages as a hit. A prefix cache file (``save``), or a KV file of sequences
    that all carry token ids. Checks all of the file first (the module doc; ``fingerprint``
    and ``convert_dtype`` as ``load_sequences``'), then the room: the pages every chain
    takes, against ``num_available_pages`` (cached pages are evicted for them, least recently
    used first). Returns the pages the index gained (where it held a prefix already, that
    copy stays and the file's is freed). Raises InvalidArgumentError (the field or page
    named) for a file that fails a check or a cache without the prefix cache,
    UnsupportedFeatureError for another version, CacheFullError without room,
    ForwardStateError inside a forward; the cache's sequences, lengths and K/V are unchanged
    then."""
    c = cache.config
    if not c.prefix_cache:
        raise InvalidArgumentError(
            f"loading the prefix cache file {str(path)!r}: the cache has no prefix cache "
            f"(CacheConfig(prefix_cache=False)); nothing was loaded")
    header, entries = files.read_payloads(path, c, fingerprint, convert_dtype)
    meta = header["sequences"]
    if header.get("contents", CONTENTS) != CONTENTS:
        raise _refuse(path, f"contents={header.get('contents')!r}, expected {CONTENTS!r}")
    full: list = []             # per entry: the ids of all its positions
    extras: list = []
    parents: list = []
    for i, ((p, toks), e) in enumerate(zip(entries, meta)):
        if toks is None:
            raise _refuse(path, f"sequence {i} has no token ids (tokens=null): the prefix "
                                f"cache finds pages by their ids")
        if p.window_size != -1:
            raise _refuse(path, f"sequence {i} has a sliding window (window_size="
                                f"{p.window_size}): its pages slid out, it is no prefix")
        try:
            extra = _decode_extra(e.get("extra_key"), f"sequence {i}")
            hash(extra)
        except (InvalidArgumentError, TypeError) as exc:
            raise _refuse(path, str(exc)) from None
        link = e.get("parent")
        parent = None if link is None else int(link[0])      # read_payloads checked it
        if parent is not None and extras[parent] != extra:
            raise _refuse(path, f"sequence {i}: extra_key={extra!r:.40} continues sequence "
                                f"{parent}, whose extra key is {extras[parent]!r:.40}")
        full.append((full[parent][:p.start] if parent is not None else []) + list(toks))
        extras.append(extra)
        parents.append(parent)
    ids = _new_ids(cache, len(entries))
    ps = c.page_size
    need = sum(import_pages(ImportSpec(sid, p.num_tokens if parent is None else p.end - p.start,
                                       parent_id=None if parent is None else ids[parent],
                                       fork_pos=0 if parent is None else p.start), ps)
               for sid, (p, _), parent in zip(ids, entries, parents))
    have = cache.num_available_pages
    if need > have:
        raise CacheFullError(
            f"prefix cache file {str(path)!r}: its {len(entries)} prefixes take {need} pages of "
            f"{ps} tokens, and {have} are available (free and cached, "
            f"num_available_pages); nothing was loaded")
    done: list = []
    try:
        for sid, (p, _), parent in zip(ids, entries, parents):
            if parent is None:
                cache.import_sequence(sid, p, convert_dtype=convert_dtype)
            else:
                cache.import_sequence(sid, p, parent_id=ids[parent], fork_pos=p.start,
                                      convert_dtype=convert_dtype)
            done.append(sid)
        # (checks its arguments before it changes anything: a refusal leaves the imports)
        return cache.manager.cache_imported(ids, full, extras)
    except BaseException:
        for sid in reversed(done):          # all or nothing: forks first, then their parents
            cache.remove_sequence(sid)
        raise


def _refuse(path, what: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"prefix cache file {str(path)!r}: {what}; nothing was loaded")


def _new_ids(cache, n: int) -> list:
    """``n`` sequence ids the cache does not hold (the chains' while they are imported)."""
    have = cache.sequence_ids
    first = max(have) + 1 if have else 0
    return list(range(first, first + n))

