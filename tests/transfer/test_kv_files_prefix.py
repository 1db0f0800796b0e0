"""The prefix cache's files (``cache.prefix_cache.save`` / ``load``, ``kvcache.prefix_files``),
the model fingerprint (``kvcache.integrations.fingerprint``) and the Engine's KV files
(``prefix_file``, ``save_prefix_cache``, ``load_prefix_cache``, ``resume``):

* a prefix cache saved on one backend loads on every other (reference, cuda's CPU test mode,
  metal on MLX's CPU device) with the same prefixes, extra keys included, each page written
  once, and the same K/V bits; a sequence added afterwards attaches them as a hit;
* loading checks everything first: another fingerprint, a flipped byte, a broken parent link,
  a file without ids, no room or no prefix cache are refused with a typed error, and the
  cache keeps its sequences, K/V and cached pages;
* an Engine started with a saved system prompt counts it in ``stats.prefix_hit_tokens`` and
  gives the tokens of one without it; another model's engine refuses the file;
* an Engine resuming a conversation another engine saved (on the same backend or another)
  gives the tokens of the conversation run as one request.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

import kvcache
from kvcache.errors import CacheFullError, InvalidArgumentError
from kvcache.files import read_header

from test_kv_files import BACKENDS, _saved
from transfer_cases import (DEVICES, assert_same_kv, caches_here, config, make_cache,
                            run_forward, snapshot)

PS = 4
"""The caches' page size (``transfer_cases.config``)."""
LORA = ("lora", 7)
"""An extra key (a tuple: the file encodes it)."""


def _conversations(seed: int = 0) -> tuple:
    """Token id lists: three conversations under one 10-token system prompt (two of them
    sharing 6 more tokens), and one of their own under the extra key ``LORA``."""
    rng = np.random.default_rng(seed)

    def ids(n):
        return rng.integers(1, 500, n).tolist()
    system, shared = ids(10), ids(6)
    plain = [system + ids(9), system + shared + ids(7), system + shared + ids(13)]
    return plain, [system + ids(11)]


def _filled(backend: str, dtype: str = "float32", seed: int = 0):
    """A prefix cache on ``backend`` holding ``_conversations``: every conversation computed
    (each from what the prefix cache held), all but the last plain one removed (their pages
    cached, unreferenced), the last one live. Returns (cache, plain, lora)."""
    cache = make_cache(backend, config(dtype=dtype, prefix_cache=True))
    rng = np.random.default_rng(seed + 1)
    plain, lora = _conversations(seed)
    convs = [(t, None) for t in plain] + [(t, LORA) for t in lora]
    for sid, (tokens, extra) in enumerate(convs):
        start = cache.add_sequence(sid, tokens, extra_key=extra)
        run_forward(cache, [sid], [len(tokens) - start], rng)
    for sid in (0, 1, 3):
        cache.remove_sequence(sid)
    return cache, plain, lora


def _index_pages(cache) -> int:
    return cache.manager.prefix.count


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("src_backend", BACKENDS)
def test_a_prefix_cache_loads_on_every_backend_bit_for_bit(tmp_path, src_backend, dtype):
    src, plain, lora = _filled(src_backend, dtype)
    path = tmp_path / "prefix.kv"
    written = src.prefix_cache.save(path, fingerprint={"model": "test"})
    # every indexed page once: the pages the conversations share are not repeated (19, 23
    # and 29 tokens sharing 2 and then 4 pages, and 21 under another key)
    assert written == _index_pages(src) == 4 + (5 - 2) + (7 - 4) + 5
    header = read_header(path)
    assert header["contents"] == "prefix-cache"
    assert sum(e["parent"] is not None for e in header["sequences"]) == 2
    for _, dst in caches_here(BACKENDS, lambda: config(dtype=dtype, prefix_cache=True)):
        assert dst.prefix_cache.load(path, fingerprint={"model": "test"}) == written
        dst.manager.prefix.check()
        assert dst.num_sequences == 0 and dst.num_cached_pages == written
        # a sequence added with a conversation's tokens attaches the same prefix as on the
        # source (a hit), holding the same K/V bits
        for i, (tokens, extra) in enumerate([(t, None) for t in plain] + [(t, LORA) for t in lora]):
            want = src.match_prefix(tokens, extra_key=extra)
            assert want > 0 and dst.match_prefix(tokens, extra_key=extra) == want
            assert dst.match_prefix(tokens, extra_key=None if extra else LORA) < want
            assert src.add_sequence(100 + i, tokens[:want + 1], extra_key=extra) == want
            assert dst.add_sequence(100 + i, tokens[:want + 1], extra_key=extra) == want
            src.popn(100 + i, 1)
            dst.popn(100 + i, 1)
            assert_same_kv(src, 100 + i, dst, 100 + i)
            src.remove_sequence(100 + i)
        dst.manager.prefix.check()


@pytest.mark.parametrize("kv_dtype", ["int4", "float8_e4m3"])
def test_quantized_pages_round_trip(tmp_path, kv_dtype):
    """Packed int4 rows and fp8 values with their scales come back as stored (reference)."""
    plain, _ = _conversations()
    src = make_cache("reference", config(prefix_cache=True, kv_dtype=kv_dtype, dtype="bfloat16"))
    src.add_sequence(1, plain[0])
    run_forward(src, [1], [len(plain[0])], np.random.default_rng(4))
    src.remove_sequence(1)
    assert src.save_prefix_cache(tmp_path / "q.kv") == 4
    dst = make_cache("reference", config(prefix_cache=True, kv_dtype=kv_dtype, dtype="bfloat16"))
    assert dst.load_prefix_cache(tmp_path / "q.kv") == 4
    assert src.add_sequence(2, plain[0]) == dst.add_sequence(2, plain[0]) == 16
    assert_same_kv(src, 2, dst, 2)
    if kv_dtype == "float8_e4m3":
        assert dst.kv_scales(0) == src.kv_scales(0)


def test_saving_conversations_writes_their_prefixes_and_a_second_load_adds_nothing(tmp_path):
    src, plain, lora = _filled("reference")
    path = tmp_path / "one.kv"
    assert src.save_prefix_cache(path, prefixes=[plain[1]]) == len(plain[1]) // PS
    assert src.save_prefix_cache(tmp_path / "none.kv", prefixes=[[1, 2, 3]]) == 0
    dst = make_cache("reference", config(prefix_cache=True, page_size=8))     # another page size
    assert dst.load_prefix_cache(tmp_path / "none.kv") == 0
    gained = dst.load_prefix_cache(path)
    assert gained == len(plain[1]) // 8 and dst.num_cached_pages == gained
    assert dst.match_prefix(plain[1]) == gained * 8
    assert dst.match_prefix(plain[2]) == 16 and dst.match_prefix(plain[0]) == 8
    # the same prefixes again: the index has them, the file's copies are freed
    assert dst.load_prefix_cache(path) == 0 and dst.num_cached_pages == gained
    assert dst.num_available_pages == dst.num_total_pages
    dst.manager.prefix.check()
    # every prefix into pages of 16: a chain that leaves another at token 8 is imported as a
    # fork inside a page (copied); each conversation's first 16 tokens are one page, the
    # second and third conversations' the same one
    src.save_prefix_cache(tmp_path / "all.kv")
    big = make_cache("reference", config(prefix_cache=True, page_size=16))
    assert big.load_prefix_cache(tmp_path / "all.kv") == 3
    assert [big.match_prefix(t) for t in plain] == [16] * 3
    assert big.match_prefix(lora[0], extra_key=LORA) == 16
    big.manager.prefix.check()


def test_a_file_of_sequences_with_ids_loads_as_cached_prefixes(tmp_path):
    """A system prompt saved with ``save_sequences`` (and its ids) loads into the prefix
    cache: its full pages are cached, its partial last page dropped."""
    src = make_cache("reference", config())
    src.add_sequence(1)
    run_forward(src, [1], [11], np.random.default_rng(2))
    system = list(range(30, 41))
    path = tmp_path / "system.kv"
    src.save_sequences(path, [1], tokens=[system])
    dst = make_cache("reference", config(prefix_cache=True))
    assert dst.load_prefix_cache(path) == 2 and dst.num_cached_pages == 2
    assert dst.add_sequence(5, system + [7]) == 8
    assert kvcache.to_numpy(dst.get_kv(5)[0]).tobytes() == \
        kvcache.to_numpy(src.get_kv(1, 0, 8)[0]).tobytes()
    # one without ids cannot be found by them
    _, _, _, mixed = _saved(tmp_path, count=2)
    with pytest.raises(InvalidArgumentError, match="sequence 1 has no token ids"):
        dst.load_prefix_cache(mixed)


def _counting(monkeypatch, cache) -> tuple:
    """(token rows read from KV files, pages reserved by ``cache``'s imports), as they grow."""
    from kvcache import files
    c = cache.config
    row = c.num_kv_heads * c.head_dim * 4               # one token's row of one layer, float32
    read, reserved = [], []
    pread = files._pread

    def counted(path, fd, out, at):
        read.append(len(out) // row)
        return pread(path, fd, out, at)

    reserve = cache.reserve_import

    def counted_reserve(items, convert_dtype=False):
        res = reserve(items, convert_dtype)
        reserved.append(res.num_pages)
        return res
    monkeypatch.setattr(files, "_pread", counted)
    monkeypatch.setattr(cache, "reserve_import", counted_reserve)
    return read, reserved


def test_a_load_reads_and_writes_only_what_the_index_lacks(tmp_path, monkeypatch):
    """Issue 57: a chain whose first pages the prefix index holds with the file's bits (its
    copy hashes to the file's page hashes) goes on from them: those pages are neither read
    from the file nor written again, and the cache ends as one that loaded the file alone,
    bit for bit, holding no page twice. Where the index's copy differs (computed here), the
    file's pages are read and imported as before; a flipped byte among them is refused with
    nothing changed."""
    src, plain, lora = _filled("reference")
    system, whole = tmp_path / "system.kv", tmp_path / "all.kv"
    assert src.save_prefix_cache(system, prefixes=[plain[0][:12]]) == 3
    written = src.save_prefix_cache(whole)
    alone = make_cache("reference", config(prefix_cache=True))
    assert alone.load_prefix_cache(whole) == written == 15
    layers = src.config.num_layers

    dst = make_cache("reference", config(prefix_cache=True))
    assert dst.load_prefix_cache(system) == 3
    read, reserved = _counting(monkeypatch, dst)
    assert dst.load_prefix_cache(whole) == written - 3
    # the 12 pages it lacked, each read once (K and V, each layer) and reserved once: the
    # first chain's fourth page, the second's three, the third's three (forked from the
    # second's) and the extra key's five (the file holds whole pages)
    assert sum(read) == 2 * layers * 12 * PS and reserved == [12]
    assert dst.num_available_pages == alone.num_available_pages == dst.num_total_pages
    assert dst.num_cached_pages == alone.num_cached_pages == written
    convs = [(t, None) for t in plain] + [(t, LORA) for t in lora]
    for i, (tokens, extra) in enumerate(convs):
        want = alone.match_prefix(tokens, extra_key=extra)
        assert want == src.match_prefix(tokens, extra_key=extra)
        assert dst.add_sequence(10 + i, tokens[:want + 1], extra_key=extra) == want
        assert alone.add_sequence(10 + i, tokens[:want + 1], extra_key=extra) == want
        assert_same_kv(alone, 10 + i, dst, 10 + i)
        dst.remove_sequence(10 + i)
    dst.manager.prefix.check()
    # a second time: nothing read, nothing reserved
    del read[:], reserved[:]
    assert dst.load_prefix_cache(whole) == 0 and read == [] and reserved == []

    # the index holds the first conversation computed here: other K/V under the same ids
    here = make_cache("reference", config(prefix_cache=True))
    here.add_sequence(1, plain[0])
    run_forward(here, [1], [len(plain[0])], np.random.default_rng(9))
    mine = [kvcache.to_numpy(a) for a in here.get_kv(1, 0, 16)]
    here.remove_sequence(1)
    read, reserved = _counting(monkeypatch, here)
    bad = bytearray(whole.read_bytes())
    (n,) = struct.unpack("<Q", bad[:8])
    first = json.loads(bad[8:8 + n])
    k0 = first["s0.k"]["data_offsets"][0]
    assert json.loads(first["__metadata__"]["kvcache"])["sequences"][0]["tokens"] == plain[0][:16]
    bad[8 + n + k0 + 5] ^= 0x08                 # a byte of the first chain's K, page 0
    (tmp_path / "bad.kv").write_bytes(bytes(bad))
    before, count = snapshot(here), _index_pages(here)
    with pytest.raises(InvalidArgumentError, match="sequence 0: page 0 .*fails its hash"):
        here.load_prefix_cache(tmp_path / "bad.kv")
    assert snapshot(here) == before and _index_pages(here) == count   # (its 11 pages back)
    here.manager.prefix.check()
    del read[:], reserved[:]
    assert here.load_prefix_cache(whole) == written - 4
    # every page read and written: the index's copy is not the file's, so it stands in for
    # none of them (as before issue 57: the chains the index holds whole keep its copy, the
    # others read the file's)
    assert sum(read) == 2 * layers * written * PS and reserved == [written]
    # (the second chain's first two pages are the file's, under the index's nodes for them)
    assert here.num_cached_pages == written + 2
    assert here.add_sequence(20, plain[0]) == 16          # the index's own copy, kept
    assert all(kvcache.to_numpy(a).tobytes() == m.tobytes()
               for a, m in zip(here.get_kv(20, 0, 16), mine))
    here.remove_sequence(20)
    assert here.add_sequence(21, plain[1]) == 20 and alone.add_sequence(21, plain[1]) == 20
    assert_same_kv(alone, 21, here, 21)                   # the file's, the system prompt too
    here.manager.prefix.check()


@pytest.mark.parametrize("page_size", [2, 8])
def test_a_load_over_any_cached_part_ends_as_the_file_alone(tmp_path, page_size):
    """A prefix cache file loaded over a part of it (random prefixes of random chains, the
    reader's pages smaller or larger than the writer's, K/V that differ between copies of
    one token's page as a random workload's do) ends as the file loaded alone: the same
    pages gained in all, the same hits, the same K/V bits, no page left over."""
    for seed in (1, 2):
        src, plain, lora = _filled("reference", seed=seed)
        convs = [(t, None) for t in plain] + [(t, LORA) for t in lora]
        whole = tmp_path / f"all{seed}.kv"
        src.save_prefix_cache(whole)
        rng = np.random.default_rng(seed)
        for pick in range(3):
            sub = [t for t, extra in convs if extra is None and rng.random() < 0.6]
            part = tmp_path / f"part{seed}-{pick}.kv"
            src.save_prefix_cache(part, prefixes=[t[:rng.integers(4, len(t) + 1)] for t in sub])
            dst = make_cache("reference", config(prefix_cache=True, page_size=page_size))
            alone = make_cache("reference", config(prefix_cache=True, page_size=page_size))
            gained = dst.load_prefix_cache(part) + dst.load_prefix_cache(whole)
            assert gained == alone.load_prefix_cache(whole)
            assert dst.num_available_pages == dst.num_total_pages
            assert dst.num_cached_pages == alone.num_cached_pages
            for i, (tokens, extra) in enumerate(convs):
                want = alone.match_prefix(tokens, extra_key=extra)
                assert dst.add_sequence(9, tokens[:want + 1], extra_key=extra) == want
                alone.add_sequence(9, tokens[:want + 1], extra_key=extra)
                assert_same_kv(alone, 9, dst, 9)
                dst.remove_sequence(9)
                alone.remove_sequence(9)
            dst.manager.prefix.check()


def _flip(path, tmp_path, find: bytes, at: int, name: str):
    raw = bytearray(path.read_bytes())
    i = raw.index(find) + at
    raw[i] ^= 0x01
    out = tmp_path / name
    out.write_bytes(bytes(raw))
    return out


def test_loading_refuses_a_mismatch_and_changes_nothing(tmp_path):
    src, plain, _ = _filled("reference")
    path = tmp_path / "prefix.kv"
    pages = src.save_prefix_cache(path, fingerprint={"model": "a", "layers": 2})
    dst, _, _ = _filled("reference", seed=5)        # other prefixes, cached and live
    cached, indexed, before = dst.num_cached_pages, _index_pages(dst), snapshot(dst)

    def unchanged():
        assert snapshot(dst) == before
        assert dst.num_cached_pages == cached and _index_pages(dst) == indexed
        assert dst.match_prefix(plain[1]) == 0
        dst.manager.prefix.check()

    with pytest.raises(InvalidArgumentError, match="fingerprint field 'model'.*nothing was loaded"):
        dst.prefix_cache.load(path, fingerprint={"model": "b", "layers": 2})
    unchanged()
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    k0 = json.loads(raw[8:8 + n])["s1.k"]["data_offsets"][0]
    bad = bytearray(raw)
    bad[8 + n + k0 + 3] ^= 0x40                      # a byte of K in the second chain
    (tmp_path / "k.kv").write_bytes(bytes(bad))
    # (the page hashes cover what the payload's CRC-32 does: the CRC is not computed on load)
    flipped = {"k.kv": "sequence 1: page 0 .*fails its hash",
               "link.kv": "parent=",                 # the parent's page hash it names
               "ids.kv": "fails its hash"}           # a token id of the first chain
    _flip(path, tmp_path, b'\\"parent\\":[0,\\"', 19, "link.kv")
    _flip(path, tmp_path, b'\\"tokens\\":[', 12, "ids.kv")
    for name, reason in flipped.items():
        with pytest.raises(InvalidArgumentError, match=reason):
            dst.load_prefix_cache(tmp_path / name)
        unchanged()
    # no room: refused before anything is imported
    small = make_cache("reference", config(prefix_cache=True, max_total_tokens=PS * (pages - 2)))
    with pytest.raises(CacheFullError, match="nothing was loaded"):
        small.load_prefix_cache(path)
    assert small.num_sequences == 0 and small.num_cached_pages == 0
    assert small.num_available_pages == small.num_total_pages
    # no prefix cache to load into or save from
    off = make_cache("reference", config())
    with pytest.raises(InvalidArgumentError, match="prefix_cache=False"):
        off.prefix_cache.load(path)
    with pytest.raises(InvalidArgumentError, match="prefix_cache=False"):
        off.prefix_cache.save(tmp_path / "off.kv")
    # an extra key a file cannot hold: refused before writing
    src.add_sequence(50, plain[0], extra_key=frozenset({1}))
    run_forward(src, [50], [len(plain[0])], np.random.default_rng(0))
    with pytest.raises(InvalidArgumentError, match="cannot be written"):
        src.save_prefix_cache(tmp_path / "x.kv")
    assert not (tmp_path / "x.kv").exists() and not (tmp_path / "off.kv").exists()
    dst.manager.prefix.check()


# ---------------------------------------------------------------------- the Engine
VOCAB = 512
NEW = 12


@pytest.fixture
def one_torch_thread():
    """torch (skipped without it and transformers) on one thread: the models are tiny, and a
    thread pool only adds contention on a loaded machine."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(model_type: str = "llama", seed: int = 3):
    """A float32 2-layer random-weight model (as tests/integrations' ``make_model``)."""
    import torch
    import transformers
    cfg = transformers.AutoConfig.for_model(
        model_type, vocab_size=VOCAB, num_hidden_layers=2, hidden_size=128,
        intermediate_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=1024, initializer_range=0.15, bos_token_id=None,
        eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    return model.to(torch.float32).eval()


@pytest.fixture
def llama(one_torch_thread):
    return _model()


def _engine(model, backend="reference", **kw):
    from kvcache.integrations.transformers import Engine
    if backend == "cuda":
        kw.setdefault("device", "cpu")
    return Engine(model, backend=backend, **{"max_total_tokens": 1024, "max_batch_size": 4,
                                             "page_size": 16, **kw})


def _greedy(n):
    from kvcache.integrations import SamplingParams
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_the_fingerprint_names_the_model(llama):
    from kvcache.integrations.fingerprint import model_fingerprint
    fp = model_fingerprint(llama)
    assert json.loads(json.dumps(fp)) == fp
    assert {k: fp[k] for k in ("library", "architecture", "num_layers", "num_qo_heads",
                               "num_kv_heads", "head_dim", "head_dim_v", "dtype")} == {
        "library": "transformers", "architecture": "LlamaForCausalLM", "num_layers": 2,
        "num_qo_heads": 4, "num_kv_heads": 2, "head_dim": 64, "head_dim_v": 64,
        "dtype": "float32"}
    assert fp["rope"]["rope_parameters"]["rope_type"] == "default" and "weights" not in fp
    other = _model(seed=4)
    assert model_fingerprint(other) == fp                   # same shapes, other weights
    heavy = model_fingerprint(llama, weights=True)
    assert heavy["weights"] != model_fingerprint(other, weights=True)["weights"]
    assert model_fingerprint(_model("qwen3"))["architecture"] == "Qwen3ForCausalLM"
    with pytest.raises(InvalidArgumentError, match="neither"):
        model_fingerprint(object())


def test_an_engine_loads_a_system_prompt_at_start_and_counts_hits(tmp_path, llama):
    rng = np.random.default_rng(7)
    system = rng.integers(1, VOCAB, 40).tolist()             # two pages of 16, and 8 more
    questions = [rng.integers(1, VOCAB, n).tolist() for n in (9, 21)]
    first = _engine(llama)
    first.generate([system + questions[0]], _greedy(2))
    path = tmp_path / "system.kv"
    assert first.save_prefix_cache(path, [system]) == 2
    assert read_header(path)["fingerprint"] == first.fingerprint
    cold = _engine(llama).generate([system + questions[1]], _greedy(NEW))
    warm = _engine(llama, prefix_file=str(path))
    assert warm.prefix_loaded == 2 and warm.cache.num_cached_pages == 2
    assert warm.stats.prefix_hit_tokens == 0
    assert warm.generate([system + questions[1]], _greedy(NEW)) == cold
    assert warm.stats.prefix_hit_tokens == 32
    # another model's engine refuses the file, naming the field; nothing is loaded
    other = _engine(_model("qwen3"))
    with pytest.raises(InvalidArgumentError, match="fingerprint field 'architecture'"):
        other.load_prefix_cache(path)
    assert other.cache.num_cached_pages == 0
    with pytest.raises(InvalidArgumentError, match="fingerprint field 'weights'"):
        _engine(llama, prefix_file=path, fingerprint_weights=True)
    with pytest.raises(InvalidArgumentError, match="prefix_cache=False"):
        _engine(llama, prefix_file=path, prefix_cache=False)


def _mlx_llama():
    """The mlx-lm twin of ``_model()`` (float32, MLX's CPU device), or a skip."""
    mx = pytest.importorskip("mlx.core")
    llama = pytest.importorskip("mlx_lm.models.llama")
    args = llama.ModelArgs.from_dict(dict(
        model_type="llama", vocab_size=VOCAB, num_hidden_layers=2, hidden_size=128,
        intermediate_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        rms_norm_eps=1e-5, tie_word_embeddings=False))
    mx.random.seed(3)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def _mlx_engine(model, **kw):
    from kvcache.integrations.mlx_lm import Engine
    try:
        return Engine(model, backend="metal", device="cpu",
                      **{"max_total_tokens": 1024, "max_batch_size": 4, "page_size": 16, **kw})
    except kvcache.BackendNotAvailableError as exc:
        pytest.skip(f"metal on MLX's CPU: {exc}")


def _resume_checked(tmp_path, make, resumed, seed: int) -> tuple:
    """A 40-token prompt: run whole (2 * NEW tokens) on one engine; its first turn on another,
    saved; the second turn resumed from the file on a third (``resumed()``): its tokens are the
    whole run's, its saved pages counted as hits. Returns ``(prompt, first turn, file)``."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, VOCAB, 40).tolist()
    whole = make().generate([prompt], _greedy(2 * NEW))[0][0]
    first = make()
    said = first.generate([prompt], _greedy(NEW))[0][0]
    assert said == whole[:NEW]
    path = tmp_path / "conversation.kv"
    pages = first.save_prefix_cache(path, [prompt + said])
    # the full pages of the ids the finished request recorded (its last token or two, whose
    # picks were on their way, are not): 3 of the conversation's 52 tokens
    assert pages == 3
    second = resumed()
    rid = second.resume(path, prompt + said, _greedy(NEW))
    got = []
    while second.has_unfinished():
        got += [t for o in second.step() if o.request_id == rid for t in o.new_token_ids]
    assert second.stats.prefix_hit_tokens == 16 * pages
    assert got == whole[NEW:]
    return prompt, said, path


@pytest.mark.parametrize("where", ["reference", "reference to cuda", "mlx-lm on metal"])
def test_an_engine_resumes_a_conversation_as_if_it_never_stopped(tmp_path, llama, where,
                                                                 monkeypatch):
    """The first turn on one engine, saved; the second on a new engine (of another backend
    for "reference to cuda"): its greedy tokens are those of the conversation run as one
    request (deterministic engines: a token's bits do not depend on whether it was
    prefilled or decoded)."""
    if where == "mlx-lm on metal":
        model = _mlx_llama()
        make = _mlx_engine
        resumed = make
    else:
        monkeypatch.setenv("KVCACHE_CUDA_CPU", "1")
        model, make = llama, _engine
        resumed = (lambda m, **kw: _engine(m, "cuda", **kw)) if where.endswith("cuda") else make
    prompt, said, path = _resume_checked(
        tmp_path, lambda: make(model, deterministic=True),
        lambda: resumed(model, deterministic=True), seed=9)
    # a bad prompt is refused before anything is loaded
    third = resumed(model)
    with pytest.raises(InvalidArgumentError, match="vocabulary"):
        third.resume(path, prompt + [VOCAB], _greedy(NEW))
    assert third.cache.num_cached_pages == 0
    if where == "mlx-lm on metal":      # the other library's model is another model
        with pytest.raises(InvalidArgumentError, match="fingerprint field 'architecture'"):
            _engine(llama).load_prefix_cache(path)


def test_a_seeded_sample_resumes_as_if_it_never_stopped(tmp_path, llama):
    """Issue 57: a sampled (seeded) conversation saved after its first turn and resumed with
    ``drawn`` (the picks its sample drew) draws the tokens of the run that never stopped;
    without it the draws count from the resumed request's start (a new turn's)."""
    from kvcache.integrations import SamplingParams

    def sampled(n):
        return SamplingParams(max_tokens=n, temperature=0.9, top_k=50, seed=77, ignore_eos=True)
    prompt = np.random.default_rng(13).integers(1, VOCAB, 40).tolist()
    whole = _engine(llama, deterministic=True).generate([prompt], sampled(2 * NEW))[0][0]
    first = _engine(llama, deterministic=True)
    said = first.generate([prompt], sampled(NEW))[0][0]
    assert said == whole[:NEW]
    path = tmp_path / "sampled.kv"
    first.save_prefix_cache(path, [prompt + said])
    got = {}
    for drawn in (NEW, 0):
        second = _engine(llama, deterministic=True)
        rid = second.resume(path, prompt + said, sampled(NEW), drawn=drawn)
        got[drawn] = []
        while second.has_unfinished():
            got[drawn] += [t for o in second.step() if o.request_id == rid
                           for t in o.new_token_ids]
    assert got[NEW] == whole[NEW:]
    assert got[0] != whole[NEW:]            # (the draws of steps 0.., not NEW..)
    with pytest.raises(InvalidArgumentError, match="drawn=-1"):
        _engine(llama).resume(path, prompt + said, sampled(NEW), drawn=-1)


@pytest.mark.skipif(DEVICES["cuda"] == "cpu", reason="the GPU run of the resume test "
                    "(KVCACHE_CUDA_TEST_DEVICE=cuda); the CPU test mode runs the one above")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engine_on_the_gpu_resumes_a_conversation(tmp_path, dtype):
    """On the GPU: the first turn on one engine, saved to a file, the second on a new engine:
    its greedy tokens are those of the conversation run as one request (deterministic
    engines), and the file loads on the reference backend with the same page bits."""
    import torch
    model = _model().to(device="cuda", dtype=getattr(torch, dtype))

    def make(**kw):
        return _engine(model, "cuda", device="cuda", dtype=dtype, deterministic=True, **kw)

    _resume_checked(tmp_path, make, make, seed=11)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "float8_e4m3"])
def test_a_prefix_cache_file_is_written_in_chunks_the_same(tmp_path, monkeypatch, kv_dtype):
    """The prefix cache's file goes through the chunked writer of ``save_sequences``: in
    chunks of one page on the threads it is, byte for byte, the file written in one piece,
    and it loads into the prefix index (plain rows through the reused buffers; int8's packed
    rows and fp8's read-back values as ``export_sequence`` gives them)."""
    from kvcache import files
    kw = {} if kv_dtype == "auto" else {"kv_dtype": kv_dtype}
    src = make_cache("reference", config(dtype="bfloat16", prefix_cache=True, **kw))
    rng = np.random.default_rng(4)
    plain, lora = _conversations(2)
    for sid, (tokens, extra) in enumerate([(t, None) for t in plain] + [(t, LORA) for t in lora]):
        start = src.add_sequence(sid, tokens, extra_key=extra)
        run_forward(src, [sid], [len(tokens) - start], rng)
    src.remove_sequence(0)
    whole = tmp_path / "whole.kv"
    pages = src.prefix_cache.save(whole)
    monkeypatch.setattr(files, "_CHUNK_BYTES", 1)          # one page a chunk
    monkeypatch.setattr(files, "_INLINE_BYTES", 0)         # every chunk on the threads
    path = tmp_path / "chunked.kv"
    assert src.prefix_cache.save(path) == pages
    assert path.read_bytes() == whole.read_bytes()
    dst = make_cache("reference", config(dtype="bfloat16", prefix_cache=True, **kw))
    assert dst.prefix_cache.load(path) == pages
    for tokens in plain:
        assert dst.match_prefix(tokens) == src.match_prefix(tokens)
