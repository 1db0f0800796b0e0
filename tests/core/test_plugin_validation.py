"""Installed plugins are validated one by one: a bad hook or a badly typed backend class makes only
that plugin unusable (listed with the reason), and a backend name registered twice is refused
rather than resolved by install order. Distributions are faked with dist-info folders in a
temporary sys.path entry (real entry-point discovery, nothing installed)."""

import re
import sys
import textwrap

import pluggy
import pytest

import kvcache
from kvcache import plugins
from kvcache.cli import main as cli

CONFIG = kvcache.CacheConfig(num_layers=1, num_qo_heads=1, num_kv_heads=1, head_dim=2,
                             dtype="float32", rope_mode="normal")


@pytest.fixture
def site(tmp_path, monkeypatch):
    """``install(dist, {entry point: module source})`` puts a distribution on sys.path; only the
    reference backend and the fake entry points load."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = ["reference"]
    modules = []

    def install(dist, entry_points):
        info = tmp_path / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        lines = []
        for ep, source in entry_points.items():
            module = f"fake_{dist.replace('-', '_')}_{ep.replace('-', '_')}"
            (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
            lines.append(f"{ep} = {module}\n")
            modules.append(module)
            names.append(ep)
        (info / "entry_points.txt").write_text("[kvcache]\n" + "".join(lines))
        monkeypatch.setenv("KVCACHE_PLUGINS", ",".join(names))

    monkeypatch.setenv("KVCACHE_PLUGINS", "reference")
    plugins.reset_plugins()
    yield install
    plugins.reset_plugins()
    for module in modules:
        sys.modules.pop(module, None)


def plugin_source(body, backends="[Fake]"):
    return ("import kvcache\nfrom kvcache.reference import ReferenceBackend\n"
            + textwrap.dedent(body)
            + f"\n@kvcache.hookimpl\ndef kvcache_register_backends():\n    return {backends}\n")


SPARE = plugin_source("""
    class Fake(ReferenceBackend):
        name, priority = "spare-test", -50
""")


def row(name):
    rows = [r for r in kvcache.list_backends() if r["name"] == name]
    assert len(rows) == 1, rows
    return rows[0]


def info_output(capsys):
    assert cli(["info"]) == 0
    return capsys.readouterr().out


BAD_PLUGINS = {
    "misspelled-hook": ("import kvcache\n@kvcache.hookimpl\ndef kvcache_register_backend():\n"
                        "    return []\n",
                        "unknown hook 'kvcache_register_backend' "
                        "(did you mean 'kvcache_register_backends'?)"),
    "extra-hook-argument": ("import kvcache\n@kvcache.hookimpl\n"
                            "def kvcache_register_backends(device):\n    return []\n",
                            "PluginValidationError"),
    "priority-str": (plugin_source("""
        class Fake(ReferenceBackend):
            name, priority = "prio-test", "high"
    """), "Fake.priority is 'high' (str), not an int"),
    "priority-bool": (plugin_source("""
        class Fake(ReferenceBackend):
            name, priority = "prio-test", True
    """), "Fake.priority is True (bool), not an int"),
    "name-list": (plugin_source("""
        class Fake(ReferenceBackend):
            name = ["x"]
    """), "Fake.name is ['x'] (list), not a non-empty string"),
    "name-auto": (plugin_source("""
        class Fake(ReferenceBackend):
            name = "auto"
    """), "Fake.name is 'auto' (str), not a non-empty string other than 'auto'"),
    "capabilities-dict": (plugin_source("""
        class Fake(ReferenceBackend):
            name, capabilities = "caps-test", {"dtypes": ("float32",)}
    """), "Fake.capabilities is {'dtypes': ('float32',)} (dict), not a kvcache.Capabilities"),
    "not-a-backend": (plugin_source("""
        class Fake:
            name, priority, capabilities = "plain-test", 1, kvcache.Capabilities()
    """), "returned <class 'fake_kvcache_bad_not_a_backend.Fake'>, not a Backend subclass"),
    "returns-a-class": (plugin_source("""
        class Fake(ReferenceBackend):
            name = "single-test"
    """, backends="Fake"), "returned <class 'fake_kvcache_bad_returns_a_class.Fake'>, not a list"),
    "abstract": (plugin_source("""
        class Fake(kvcache.Backend):
            name = "abstract-test"
    """), "Fake does not implement the abstract methods allocate_pages, "),
}


@pytest.mark.parametrize("case", sorted(BAD_PLUGINS))
def test_bad_plugin_is_listed_and_breaks_nothing_else(site, case, capsys):
    source, reason = BAD_PLUGINS[case]
    site("kvcache-bad", {case: source})
    site("kvcache-spare", {"spare": SPARE})

    bad = row(case)
    assert not bad["available"] and bad["class"] is None and bad["priority"] is None
    assert reason in bad["reason"], bad["reason"]
    assert kvcache.available_backends() == ["reference", "spare-test"]
    assert kvcache.PagedKVCache(CONFIG, backend="reference").backend.name == "reference"
    assert kvcache.PagedKVCache(CONFIG).backend.name == "reference"
    assert kvcache.PagedKVCache(CONFIG, backend="spare-test").backend.name == "spare-test"
    with pytest.raises(kvcache.BackendNotAvailableError, match=f"{case}: unavailable"):
        kvcache.PagedKVCache(CONFIG, backend="nope")
    line = next(ln for ln in info_output(capsys).splitlines() if ln.startswith(case + " "))
    assert "unavailable" in line and reason in line


def test_kvcache_info_survives_a_backend_whose_platform_raises(site, capsys):
    site("kvcache-odd", {"odd": plugin_source("""
        class Fake(ReferenceBackend):
            name, priority = "odd-test", 5

            @classmethod
            def platform(cls):
                raise RuntimeError("driver query failed")
    """)})
    out = info_output(capsys)
    assert "[odd-test]" in out and "  error:              RuntimeError: driver query failed" in out
    assert "[reference]" in out.split("[odd-test]")[1]          # listed after the failing one


def test_misspelled_hook_in_process_is_refused_and_leaves_nothing_behind(monkeypatch):
    monkeypatch.setenv("KVCACHE_PLUGINS", "reference")

    class Typo:
        @kvcache.hookimpl
        def kvcache_register_backend(self):
            return []
    plugins.reset_plugins()
    try:
        with pytest.raises(pluggy.PluginValidationError,
                           match="unknown hook 'kvcache_register_backend'"):
            plugins.register_plugin(Typo(), name="typo-test")
        assert plugins.get_plugin_manager().get_plugin("typo-test") is None
        plugins.get_plugin_manager().check_pending()      # nothing unverified was left registered
        assert "reference" in kvcache.available_backends()
    finally:
        plugins.reset_plugins()


def duplicate_source(cls_name):
    return plugin_source(f"""
        class {cls_name}(ReferenceBackend):
            name, priority = "reference", 1000
    """, backends=f"[{cls_name}]")


def test_second_distribution_registering_reference_is_refused_naming_both(site, capsys):
    """Both entry points are named 'reference' too: before, one of them was silently skipped."""
    site("kvcache-evil", {"reference": duplicate_source("EvilReference")})
    site("kvcache-spare", {"spare": SPARE})

    ref = row("reference")
    assert not ref["available"] and ref["class"] is None
    reason = ref["reason"]
    assert reason.startswith("duplicate backend name 'reference': ")
    assert re.search(r"kvcache\.reference\.ReferenceBackend \(distribution kvcache \S+, "
                     r"entry point 'reference'\)", reason), reason
    assert ("fake_kvcache_evil_reference.EvilReference (distribution kvcache-evil 1.0, "
            "entry point 'reference')") in reason
    with pytest.raises(kvcache.BackendNotAvailableError) as err:
        kvcache.PagedKVCache(CONFIG, backend="reference")
    text = str(err.value)
    assert "backend 'reference' is not available: duplicate backend name" in text
    assert "distribution kvcache-evil 1.0" in text and re.search(r"distribution kvcache \d", text)
    # auto skips the ambiguous name (whichever priority either side claims)
    assert kvcache.PagedKVCache(CONFIG).backend.name == "spare-test"
    assert kvcache.available_backends() == ["spare-test"]
    line = next(ln for ln in info_output(capsys).splitlines() if ln.startswith("reference "))
    assert "unavailable" in line and "duplicate backend name 'reference'" in line
    assert "kvcache-evil 1.0" in line


def test_duplicate_backend_name_from_two_entry_points(site, monkeypatch):
    site("kvcache-one", {"dup-one": duplicate_source("One").replace('"reference"', '"dup-test"')})
    site("kvcache-two", {"dup-two": duplicate_source("Two").replace('"reference"', '"dup-test"')})

    reason = row("dup-test")["reason"]
    assert "fake_kvcache_one_dup_one.One (distribution kvcache-one 1.0, entry point 'dup-one')" in reason
    assert "fake_kvcache_two_dup_two.Two (distribution kvcache-two 1.0, entry point 'dup-two')" in reason
    with pytest.raises(kvcache.BackendNotAvailableError,
                       match=r"^backend 'dup-test' is not available: duplicate backend name "
                             r"'dup-test': (?=.*kvcache-one 1\.0)(?=.*kvcache-two 1\.0)"):
        kvcache.PagedKVCache(CONFIG, backend="dup-test")
    assert kvcache.PagedKVCache(CONFIG).backend.name == "reference"   # not the priority-1000 pair
    assert row("reference")["available"]

    monkeypatch.setenv("KVCACHE_PLUGINS", "reference,dup-two")         # the user picks one
    plugins.reset_plugins()
    cache = kvcache.PagedKVCache(CONFIG, backend="dup-test")
    assert type(cache.backend).__name__ == "Two"
    assert kvcache.PagedKVCache(CONFIG).backend.name == "dup-test"


def test_in_process_duplicate_and_same_class_twice(monkeypatch):
    monkeypatch.setenv("KVCACHE_PLUGINS", "reference")
    from kvcache.reference import ReferenceBackend

    class Shadow(ReferenceBackend):
        pass                                  # inherits name 'reference'

    class Same:
        @kvcache.hookimpl
        def kvcache_register_backends(self):
            return [ReferenceBackend]         # the very same class: not ambiguous

    class Shadowing:
        @kvcache.hookimpl
        def kvcache_register_backends(self):
            return [Shadow]

    plugins.reset_plugins()
    try:
        plugins.register_plugin(Same(), name="same-test")
        assert plugins.resolve_backend("reference") is ReferenceBackend
        plugins.register_plugin(Shadowing(), name="shadow-test")
        with pytest.raises(kvcache.BackendNotAvailableError,
                           match=r"plugin 'shadow-test', registered in-process"):
            plugins.resolve_backend("reference")
    finally:
        plugins.reset_plugins()
