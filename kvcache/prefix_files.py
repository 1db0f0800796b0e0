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

Loading checks every header first (``files.check_payloads``: bounds, header, format and
version, fingerprint, each payload's fit, the parent links, then the prefix cache's own
fields), then skips what the prefix index holds already: each chain goes on from the
index's pages (pinned while the load runs: ``KVManager.cached_run`` / ``hold_prefix``) or
from the sequence of the chain it continues, the index's copy of the skipped tokens hashed
against the file's page hashes instead of reading the file. Then the room, then the rest is
read a chunk of pages at a time into reserved pages (``files.stream_payload``), every page
hash checked before anything appears (the CRC-32, which they cover, is not computed). Each
imported chain records its ids (``KVManager.cache_imported``) and is removed, so its pages
stay in the index as cached pages: unreferenced, evictable, and attached by a later
``add_sequence`` whose tokens begin with them, as if a request had computed them here. A
plain KV file of sequences with token ids loads too (each sequence a chain from token 0; a
partial last page is dropped).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence

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
class _Plan(NamedTuple):
    """How one entry of a prefix cache file loads (``_plan``)."""

    base: Any
    """Where its tokens before ``fork`` come from: ("cached", holder, length) the first
    ``length`` tokens of the prefix index's pages (``KVManager.cached_run``), ("entry", j)
    entry j's sequence, or None (it starts at token 0 and ``fork`` is 0)."""
    fork: int
    """Its first token the load writes (a position in the whole prefix)."""
    needed: bool
    """Whether it is imported: it brings full pages the index lacks, or an entry forks from
    it."""
    cached_pages: int
    """Its own pages (the file's page size) whose tokens the index holds with the file's
    bits (checked against the file's page hashes: ``files.rows_chain``): not read."""


def load(cache: "PagedKVCache", path, fingerprint: Optional[dict] = None,
         convert_dtype: bool = False) -> int:
    """Put the prefixes of the file ``path`` into ``cache``'s prefix cache as cached pages
    (unreferenced, evictable): a later ``add_sequence`` whose tokens begin with one of them
    attaches its pages as a hit. A prefix cache file (``save``), or a KV file of sequences
    that all carry token ids. Checks every header first (the module doc; ``fingerprint`` and
    ``convert_dtype`` as ``load_sequences``'), then which tokens of each chain the index
    holds already with the file's bits (its copy hashed against the file's page hashes):
    those are neither read nor imported (the chain goes on from the index's pages, a fork of
    them), so the load ends as the file's alone would. Then the room: the pages the rest
    takes, against ``num_available_pages`` (cached pages are evicted for them, least
    recently used first, the ones the load starts from kept).
    The rest is read a chunk of pages at a time into pages reserved for it and every page
    hash checked before anything appears. Returns the pages the index gained (0 for a file
    whose prefixes it holds). Raises InvalidArgumentError (the field or page named) for a
    file that fails a check or a cache without the prefix cache, UnsupportedFeatureError
    for another version, CacheFullError without room, ForwardStateError inside a forward;
    the cache's sequences, lengths, K/V and prefix index are unchanged then."""
    c = cache.config
    if not c.prefix_cache:
        raise InvalidArgumentError(
            f"loading the prefix cache file {str(path)!r}: the cache has no prefix cache "
            f"(CacheConfig(prefix_cache=False)); nothing was loaded")
    header, entries = files.check_payloads(path, c, fingerprint, convert_dtype)
    meta = header["sequences"]
    if header.get("contents", CONTENTS) != CONTENTS:
        raise _refuse(path, f"contents={header.get('contents')!r}, expected {CONTENTS!r}")
    full: list = []             # per entry: the ids of all its positions
    extras: list = []
    for i, (en, e) in enumerate(zip(entries, meta)):
        p = en.payload
        if en.tokens is None:
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
        if en.parent is not None and extras[en.parent] != extra:
            raise _refuse(path, f"sequence {i}: extra_key={extra!r:.40} continues sequence "
                                f"{en.parent}, whose extra key is {extras[en.parent]!r:.40}")
        full.append((full[en.parent][:p.start] if en.parent is not None else []) + en.tokens)
        extras.append(extra)
    cache.state.check_imports([])      # (a cache that cannot import refuses before the pins)
    fmt = c.kv_format
    streamed = all(en.payload.array_dtype == fmt.payload_dtype(c.dtype) and (
        not fmt.packed or (en.payload.kv_dtype, en.payload.kv_quant_group, en.payload.dtype)
        == (c.kv_dtype, c.kv_quant_group, c.dtype)) for en in entries)
    plans = _plan(cache, header, entries, full, extras, streamed)
    payloads = None if streamed else _read_checked(path, header, entries)
    ids = _new_ids(cache, 2 * len(entries))
    seq_of, pins = ids[:len(entries)], ids[len(entries):]
    held: dict = {}             # (holder, tokens) -> the id of the sequence pinning them
    done: list = []             # the entries' sequences added
    try:
        for plan in plans:      # the cached bases first, pinned: eviction for room keeps them
            key = None if plan.base is None else plan.base[1:]
            if plan.needed and plan.base is not None and plan.base[0] == "cached" \
                    and key not in held:
                cache.manager.hold_prefix(pins[len(held)], *plan.base[1:])
                held[key] = pins[len(held)]
        items, want = [], []
        for i, (en, plan) in enumerate(zip(entries, plans)):
            if not plan.needed:
                continue
            base = plan.base
            parent = (None if base is None else held[base[1:]] if base[0] == "cached"
                      else seq_of[base[1]])
            items.append((seq_of[i], en.payload if payloads is None else payloads[i], parent,
                          None if parent is None else plan.fork))
            want.append(i)
        ps = c.page_size
        need = sum(import_pages(ImportSpec(sid, p.end - (fork or 0), parent_id=parent,
                                           fork_pos=fork or 0), ps)
                   for sid, p, parent, fork in items)
        have = cache.num_available_pages
        if need > have:
            raise CacheFullError(
                f"prefix cache file {str(path)!r}: its {len(entries)} prefixes take {need} "
                f"pages of {ps} tokens beyond those the prefix cache holds, and {have} are "
                f"available (free and cached, num_available_pages); nothing was loaded")
        if payloads is None:
            _import_streamed(cache, path, header, entries, plans, items, want)
        else:
            for sid, p, parent, fork in items:
                cache.import_sequence(sid, p, parent_id=parent, fork_pos=fork,
                                      convert_dtype=convert_dtype)
                done.append(sid)
        done = [sid for sid, _, _, _ in items]
        # (checks its arguments before it changes anything: a refusal leaves the imports)
        gained = cache.manager.cache_imported(done, [full[i] for i in want],
                                              [extras[i] for i in want])
        done = []
        return gained
    finally:
        for sid in reversed(done):          # all or nothing: forks first, then their parents
            cache.remove_sequence(sid)
        for pin in held.values():           # the pinned pages stay cached, as they were
            cache.remove_sequence(pin)


def _plan(cache, header: dict, entries: list, full: list, extras: list,
          streamed: bool) -> list:
    """Per entry its ``_Plan``. The index's longest cached prefix of the entry's whole ids
    (``cached_run``, whole pages of the cache) is checked against the file's page hashes
    from the entry's own start (the index's copy hashed: ``files.rows_chain``; ``streamed``
    only, where the cache's rows are the file's format): the tokens up to the last page that
    agrees are taken from the index (neither read nor written), the rest imported as a fork
    of them. So the index's pages stand in for the file's only where they hold the file's
    bits, and a load ends as the load of the file alone would. An entry whose parent's
    tokens up to its start are not all so taken forks from its parent's sequence; one that
    brings no full page and that no imported entry forks from is not imported. Changes
    nothing."""
    mgr, ps, wps = cache.manager, cache.config.page_size, header["page_size"]
    metas = header["sequences"]
    bases: list = []            # per entry: _Plan.base
    forks: list = []            # per entry: _Plan.fork
    kept: list = []             # per entry: its prefix's tokens the index holds as the file
    verified: list = []
    for i, (en, ids, extra) in enumerate(zip(entries, full, extras)):
        p = en.payload
        length, holder = mgr.cached_run(ids, extra)
        if en.parent is not None and (kept[en.parent] < p.start or length < p.start):
            bases.append(("entry", en.parent))      # from its parent's sequence
            forks.append(p.start)
            kept.append(kept[en.parent])
            verified.append(0)
            continue
        good = 0
        own = (length - p.start) // wps if streamed else 0
        if own > 0:
            pt = cache.state.pt
            slots = pt.position_slots(pt.seqs[holder], p.start, p.start + own * wps)
            got = files.rows_chain(_rows(cache, slots), metas[i]["payload"], p,
                                   en.tokens[:own * wps], wps, own * wps)
            bad = files.first_difference(got, metas[i]["pages"][:own])
            good = own if bad is None else bad
        fork = p.start + good * wps
        bases.append(("cached", holder, length) if fork else None)
        forks.append(fork)
        kept.append(fork)
        verified.append(good)
    needed = [False] * len(entries)
    for i in reversed(range(len(entries))):     # an entry forks from its parent only
        needed[i] = needed[i] or entries[i].payload.end // ps * ps > forks[i]
        base = bases[i]
        if needed[i] and base is not None and base[0] == "entry":
            needed[base[1]] = True
    return [_Plan(*plan) for plan in zip(bases, forks, needed, verified)]


def _import_streamed(cache, path, header: dict, entries: list, plans: list, items: list,
                     want: list) -> None:
    """Reserve the pages of ``items`` (``reserve_import``), read every entry's pages the
    index's copy did not vouch for (``files.stream_payload``: a chunk at a time, every page
    hash checked), writing the tokens of each imported entry from its ``fork`` on, and commit;
    any failure gives the pages back (``cancel_import``)."""
    res = cache.reserve_import(items) if items else None
    try:
        slot = {i: k for k, i in enumerate(want)}
        for i, (en, plan) in enumerate(zip(entries, plans)):
            k = slot.get(i)
            files.stream_payload(
                cache, path, header, i, en, None if k is None else res,
                offset=0 if k is None or res is None else int(res.offsets[k]),
                first_page=plan.cached_pages, write_from=plan.fork - en.payload.start)
        if res is not None:
            cache.commit_import(res)
    except BaseException:
        if res is not None:
            cache.cancel_import(res)
        raise


def _read_checked(path, header: dict, entries: list) -> list:
    """The entries' payloads read whole (a cache that converts them: another dtype or
    format), every page hash checked first."""
    out = []
    for i, en in enumerate(entries):
        p = files.read_payload(path, en)
        files.check_pages(path, header, i, p)
        out.append(p)
    return out


def _refuse(path, what: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"prefix cache file {str(path)!r}: {what}; nothing was loaded")


def _new_ids(cache, n: int) -> list:
    """``n`` sequence ids the cache does not hold (the chains' while they are imported)."""
    have = cache.sequence_ids
    first = max(have) + 1 if have else 0
    return list(range(first, first + n))

