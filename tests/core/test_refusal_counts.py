"""A cache's refusals count pages as the cache reports them (issue 53 item 6): "1 page", not
"1 pages", and a refusal with pages held by the prefix cache names them and the
``num_available_pages`` they add up to."""

from __future__ import annotations

import re

import pytest

import kvcache
from test_prefix_cache import make, run, serve


def test_a_refusal_with_cached_pages_adds_up_to_num_available_pages():
    cache = make(tokens=16)                              # 4 pages of 4 tokens + 1 spare
    serve(cache, 0, list(range(10, 18)))
    serve(cache, 1, list(range(30, 38)))
    cache.remove_sequence(0)                             # its 2 full pages stay cached
    free = cache.num_available_pages - cache.num_cached_pages
    assert (cache.num_total_pages, cache.num_available_pages, cache.num_cached_pages) == (5, 3, 2)
    cache.add_sequence(2, list(range(50, 66)))
    with pytest.raises(kvcache.CacheFullError) as err:
        run(cache, 2, list(range(50, 66)), 0)
    message = str(err.value)
    m = re.search(r"needs (\d+) new pages but (\d+) of 5 are free .*; the prefix cache holds "
                  r"(\d+) pages more that eviction would free \(num_available_pages=(\d+)\), "
                  r"short of the (\d+) pages missing", message)
    assert m, message
    need, free_said, cached, available, short = map(int, m.groups())
    assert (free_said, cached, available) == (free, 2, cache.num_available_pages), message
    assert need == 4 and short == need - free, message
    assert cache.num_cached_pages == 2                   # refused: nothing was evicted


def test_one_page_is_singular():
    cache = make(prefix_cache=False, tokens=8)           # 2 pages + 1 spare
    serve(cache, 0, list(range(12)))                     # 3 full pages: none free
    assert cache.num_available_pages == 0
    with pytest.raises(kvcache.CacheFullError) as err:
        run(cache, 0, [99], 12)
    message = str(err.value)
    assert "needs 1 new page but 0 of 3 are free" in message, message
    assert "1 pages" not in message and "1 tokens" not in message, message
