"""The plugin registry, in process: hooks, load isolation, duplicates, protocol versions, lookup, selection.

Plugins here are plain objects with ``@hookimpl`` methods registered through
``Registry.register_module`` (as datasette and llm test their hooks); the real pip-installed path is
in ``test_third_party_plugin.py``.  ``test_hook_<hook name>`` tests are what ``test_hook_docs.py``
looks for: one per hook spec, each exercising an installed implementation and a test plugin.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

import corerun.plugin.registry as registry_module
from corerun import (
    AttentionCapabilities,
    GraphRunnerCapabilities,
    KVCacheCapabilities,
    SamplerCapabilities,
    hookimpl,
)
from corerun._version import PROTOCOL_VERSION, __version__
from corerun.cli.plugins import describe, render
from corerun.config import load_config
from corerun.errors import PluginError, PluginNotFoundError, PluginUnavailableError
from corerun.protocols import AttentionSpec
from corerun.plugin.registry import Registry, resolve

HOOK_OF = {
    "attention": "corerun_attention_backends",
    "kv_cache": "corerun_kv_cache_managers",
    "graph": "corerun_graph_runners",
    "sampler": "corerun_samplers",
}


class Provides:
    """A plugin object: ``Provides(attention=[("mine", factory, {...register kwargs})], sampler=[...])``."""

    def __init__(self, **by_kind: list[tuple[str, Any, dict[str, Any]]]) -> None:
        self.by_kind = by_kind

    def _emit(self, kind: str, register: Any) -> None:
        for name, factory, kwargs in self.by_kind.get(kind, []):
            register(name, factory, **kwargs)

    @hookimpl
    def corerun_attention_backends(self, register: Any) -> None:
        self._emit("attention", register)

    @hookimpl
    def corerun_kv_cache_managers(self, register: Any) -> None:
        self._emit("kv_cache", register)

    @hookimpl
    def corerun_graph_runners(self, register: Any) -> None:
        self._emit("graph", register)

    @hookimpl
    def corerun_samplers(self, register: Any) -> None:
        self._emit("sampler", register)


class Recorder:
    """A factory that returns a record of how it was called."""

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return args, kwargs


class WindowOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    window: int = Field(0, ge=0)
    causal: bool = True


def builtins_only(*plugins: tuple[Any, str, str]) -> Registry:
    """A registry with corerun's built-ins and ``(plugin object, plugin id, distribution)`` entries."""
    reg = Registry()
    reg.register_module(importlib.import_module("corerun.plugin.builtin"), plugin="corerun", distribution="corerun", version=__version__)
    for obj, plugin, dist in plugins:
        reg.register_module(obj, plugin=plugin, distribution=dist, version="1.2.3")
    return reg


def spec(dtype: torch.dtype = torch.float16, head_size: int = 64, block_size: int = 16, device: str = "cpu") -> AttentionSpec:
    return AttentionSpec(num_heads=8, num_kv_heads=2, head_size=head_size, dtype=dtype, block_size=block_size, device=torch.device(device))


# ------------------------------------------------------------------ one test per hook spec


def test_hook_corerun_attention_backends() -> None:
    reg = Registry.from_environment(allow=["attention_triton", "attention_flash"])
    torch_reg = reg.get("attention", "torch")
    assert (torch_reg.plugin, torch_reg.distribution, torch_reg.version, torch_reg.builtin) == ("corerun", "corerun", __version__, True)
    assert "float64" in torch_reg.capabilities.dtypes
    assert resolve(torch_reg.factory).__name__ == "TorchAttentionBackend"
    assert reg.get("attention", "triton").distribution == "corerun-attention-triton"
    assert reg.get("attention", "flash").distribution == "corerun-attention-flash"

    plugin = Provides(attention=[("mine", Recorder(), {"options": WindowOptions, "capabilities": AttentionCapabilities()})])
    reg = builtins_only((plugin, "mine", "corerun-attention-mine"))
    mine = reg.get("attention", "mine")
    assert (mine.plugin, mine.distribution, mine.version, mine.builtin) == ("mine", "corerun-attention-mine", "1.2.3", False)
    s = spec()
    assert reg.create("attention", "mine", s, options={"window": 4}) == ((s,), {"window": 4, "causal": True})


def test_hook_corerun_kv_cache_managers() -> None:
    paged = builtins_only().get("kv_cache", "paged")
    assert (paged.distribution, paged.capabilities) == ("corerun", KVCacheCapabilities(prefix_caching=True))
    assert resolve(paged.factory).__name__ == "PagedKVCacheManager"

    plugin = Provides(kv_cache=[("lru", Recorder(), {"capabilities": KVCacheCapabilities(prefix_caching=False)})])
    reg = builtins_only((plugin, "lru", "corerun-kv-lru"))
    assert reg.create("kv_cache", "lru", 100, 16, prefix_caching=False) == ((100, 16), {"prefix_caching": False})
    assert reg.names("kv_cache") == ["lru", "paged"]


def test_hook_corerun_graph_runners() -> None:
    reg = builtins_only()
    assert reg.names("graph") == ["compile", "cuda", "eager", "replay"]
    assert reg.get("graph", "eager").available
    assert reg.get("graph", "cuda").capabilities == GraphRunnerCapabilities(devices=frozenset({"cuda"}), captures=True)
    if not torch.cuda.is_available():
        assert not reg.get("graph", "cuda").available
        assert any("CUDA" in r for r in reg.get("graph", "cuda").unavailable_reasons())

    plugin = Provides(graph=[("recorder", Recorder(), {})])
    reg = builtins_only((plugin, "recorder", "corerun-recorder"))
    assert reg.create("graph", "recorder", "model", "attention", "limits") == (("model", "attention", "limits"), {})


def test_hook_corerun_samplers() -> None:
    reg = Registry.from_environment(allow=["sampler_basic"])
    basic, full = reg.get("sampler", "basic"), reg.get("sampler", "full")
    assert (basic.distribution, full.distribution) == ("corerun-sampler-basic", "corerun")  # full is built in
    assert {"temperature", "seed"} <= basic.capabilities.params
    assert {"top_k", "top_p", "min_p", "repetition_penalty"} <= full.capabilities.params
    assert full.validate_options({}, "sampler") == {}

    plugin = Provides(sampler=[("greedy", Recorder(), {"capabilities": SamplerCapabilities(params=frozenset())})])
    reg = builtins_only((plugin, "greedy", "corerun-greedy"))
    assert reg.create("sampler", "greedy", 49152, "cpu") == ((49152, "cpu"), {})


# ------------------------------------------------------------------ one plugin's failure stays its own


def test_hook_asking_for_an_argument_the_spec_lacks_is_a_load_error() -> None:
    class Greedy:
        @hookimpl
        def corerun_samplers(self, register: Any, vocab: Any) -> None:  # no spec passes `vocab`
            register("greedy", Recorder())

    good = Provides(sampler=[("ok", Recorder(), {})])
    reg = builtins_only((Greedy(), "greedy", "corerun-greedy"), (good, "good", "corerun-good"))
    (error,) = reg.load_errors
    assert (error.plugin, error.distribution) == ("greedy", "corerun-greedy")
    assert "vocab" in error.error
    assert reg.names("sampler") == ["full", "ok"]  # the built-in and the good plugin's


def test_unknown_hook_name_is_a_load_error_of_that_plugin_only() -> None:
    class Typo:
        @hookimpl
        def corerun_atention_backends(self, register: Any) -> None:
            register("typo", Recorder())

    good = Provides(attention=[("mine", Recorder(), {})])
    reg = builtins_only((Typo(), "typo", "corerun-typo"), (good, "mine", "corerun-attention-mine"))
    reg.pm.check_pending()  # the bad plugin was unregistered, so this no longer raises for everyone
    (error,) = reg.load_errors
    assert (error.plugin, error.distribution) == ("typo", "corerun-typo")
    assert "'corerun_atention_backends' (did you mean 'corerun_attention_backends'?)" in error.error
    assert reg.names("attention") == ["mine", "torch"]
    assert "typo" not in reg.plugins


def test_hook_function_without_the_decorator_is_reported() -> None:
    class Forgot:
        def corerun_samplers(self, register: Any) -> None:
            register("forgot", Recorder())

    reg = builtins_only((Forgot(), "forgot", "corerun-forgot"))
    (error,) = reg.load_errors
    assert error.error == "defines corerun_samplers without the @corerun.hookimpl decorator, so corerun would never call it"


def test_hook_that_raises_is_reported_and_the_rest_work() -> None:
    class Crashes:
        @hookimpl
        def corerun_samplers(self, register: Any) -> None:
            raise RuntimeError("libfoo.so: cannot open shared object file")

    good = Provides(sampler=[("ok", Recorder(), {})])
    reg = builtins_only((Crashes(), "crashes", "corerun-crashes"), (good, "good", "corerun-good"))
    (error,) = reg.load_errors
    assert (error.plugin, error.distribution) == ("crashes", "corerun-crashes")
    assert error.error == "hook corerun_samplers raised RuntimeError: libfoo.so: cannot open shared object file"
    assert reg.get("sampler", "ok").distribution == "corerun-good"


# ------------------------------------------------------------------ duplicates


def test_duplicate_name_is_an_error_naming_both_distributions() -> None:
    a = Provides(attention=[("fast", Recorder(), {})])
    b = Provides(attention=[("fast", Recorder(), {}), ("other", Recorder(), {})])
    reg = builtins_only((a, "fast_a", "corerun-fast-a"), (b, "fast_b", "corerun-fast-b"))
    expected = (
        "attention backend name 'fast' is registered by both corerun-fast-a (plugin 'fast_a') and corerun-fast-b "
        "(plugin 'fast_b'), so neither is used; remove one: `pip uninstall corerun-fast-a` or "
        "`pip uninstall corerun-fast-b` (or load only one, e.g. CORERUN_PLUGINS=fast_a)"
    )
    assert [e.error for e in reg.load_errors] == [expected]
    with pytest.raises(PluginError) as err:
        reg.get("attention", "fast")
    assert str(err.value) == expected
    assert "fast" not in reg.names("attention")  # no silent last-wins
    assert reg.get("attention", "other").distribution == "corerun-fast-b"


def test_third_registrant_of_a_name_is_named_too() -> None:
    plugins = [(Provides(sampler=[("same", Recorder(), {})]), f"p{i}", f"corerun-p{i}") for i in range(3)]
    reg = builtins_only(*plugins)
    with pytest.raises(PluginError, match="corerun-p0 .* and corerun-p1 .* and corerun-p2"):
        reg.get("sampler", "same")


@pytest.mark.parametrize("first", [True, False], ids=["plugin-loads-after", "plugin-loads-before"])
def test_builtin_name_cannot_be_taken_over(first: bool) -> None:
    evil = (Provides(attention=[("torch", Recorder(), {}), ("extra", Recorder(), {})]), "evil", "corerun-evil")
    if first:
        reg = builtins_only(evil)
    else:  # whatever the loading order, the built-in keeps its name
        reg = Registry()
        reg.register_module(evil[0], plugin="evil", distribution="corerun-evil", version="6.6")
        reg.register_module(importlib.import_module("corerun.plugin.builtin"), plugin="corerun", distribution="corerun", version=__version__)
    assert reg.get("attention", "torch").distribution == "corerun"
    assert reg.get("attention", "extra").distribution == "corerun-evil"  # the rest of the plugin keeps working
    (error,) = reg.load_errors
    assert (error.plugin, error.distribution) == ("evil", "corerun-evil")
    assert error.error.startswith(
        "attention backend name 'torch' belongs to corerun (built-in); the one corerun-evil (plugin 'evil') "
        "registers is ignored"
    )
    assert "pip uninstall corerun-evil" in error.error and "uninstall corerun " not in error.error


def test_first_party_name_cannot_be_taken_over_by_a_third_party() -> None:
    real, evil = Recorder(), Recorder()
    reg = Registry()
    reg.register_module(Provides(sampler=[("basic", evil, {})]), plugin="evil", distribution="corerun-evil", version="1")
    reg.register_module(Provides(sampler=[("basic", real, {})]), plugin="sampler_basic", distribution="corerun-sampler-basic", version="0.1.0")
    assert reg.get("sampler", "basic").factory is real
    assert reg.get("sampler", "basic").origin == "first-party"  # corerun's metadata lists corerun-sampler-basic as an extra
    assert [e.distribution for e in reg.load_errors] == ["corerun-evil"]
    assert "belongs to corerun-sampler-basic (first-party)" in reg.load_errors[0].error


def test_a_first_party_arriving_after_a_tie_takes_its_name() -> None:
    real = Recorder()
    reg = Registry()
    for i in (1, 2):
        reg.register_module(Provides(sampler=[("basic", Recorder(), {})]), plugin=f"t{i}", distribution=f"corerun-t{i}", version="1")
    reg.register_module(Provides(sampler=[("basic", real, {})]), plugin="sampler_basic", distribution="corerun-sampler-basic", version="0.1.0")
    reg.register_module(Provides(sampler=[("basic", Recorder(), {})]), plugin="t3", distribution="corerun-t3", version="1")
    assert reg.get("sampler", "basic").factory is real
    assert [e.distribution for e in reg.load_errors] == ["corerun-t1", "corerun-t2", "corerun-t3"]
    assert all("belongs to corerun-sampler-basic (first-party)" in e.error for e in reg.load_errors)


def test_duplicate_plugin_id_is_a_load_error() -> None:
    reg = builtins_only(
        (Provides(sampler=[("one", Recorder(), {})]), "same_id", "corerun-one"),
        (Provides(sampler=[("two", Recorder(), {})]), "same_id", "corerun-two"),
    )
    assert [(e.distribution, e.error) for e in reg.load_errors] == [
        ("corerun-two", "plugin id 'same_id' is already used by distribution corerun-one")
    ]
    assert reg.names("sampler") == ["full", "one"]


# ------------------------------------------------------------------ protocol version


@pytest.mark.parametrize(("declared", "upgrade"), [(PROTOCOL_VERSION - 1, "corerun-old"), (PROTOCOL_VERSION + 1, "corerun")])
def test_protocol_version_mismatch_is_a_clear_error(declared: int, upgrade: str) -> None:
    plugin = Provides(attention=[("old", Recorder(), {"protocol_version": declared})])
    reg = builtins_only((plugin, "old", "corerun-old"))
    (error,) = reg.load_errors
    assert error.error == (
        f"hook corerun_attention_backends raised ProtocolVersionError: attention backend 'old' from corerun-old "
        f"implements corerun protocol version {declared}, but this corerun {__version__} implements version "
        f"{PROTOCOL_VERSION}; upgrade {upgrade}"
    )
    with pytest.raises(PluginNotFoundError) as err:
        reg.get("attention", "old")
    assert f"implements corerun protocol version {declared}" in str(err.value)  # the lookup says why


# ------------------------------------------------------------------ unknown names (from YAML)


def _get_from_yaml(reg: Registry, tmp_path: Path, text: str, kind: str) -> str:
    path = tmp_path / "corerun.yaml"
    path.write_text(text)
    cfg = load_config(path)
    choice = cfg.attention if kind == "attention" else cfg.sampler
    with pytest.raises(PluginNotFoundError) as err:
        reg.get(kind, choice.name)
    assert isinstance(err.value, LookupError)
    return str(err.value)


def test_unknown_backend_name_suggests_the_installed_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CORERUN_PLUGINS", raising=False)
    reg = Registry.from_environment(allow=["attention_triton", "attention_flash"])
    msg = _get_from_yaml(reg, tmp_path, "attention: tritonn\n", "attention")
    assert msg == (
        "no attention backend named 'tritonn'. Installed: flash (corerun-attention-flash), torch (corerun), "
        "triton (corerun-attention-triton). Did you mean 'triton'? CORERUN_PLUGINS=attention_triton,attention_flash "
        "is set: only those plugin ids (and the built-ins) load."
    )


def test_unknown_name_of_a_known_plugin_gives_the_pip_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CORERUN_PLUGINS", raising=False)
    reg = builtins_only()  # as if no plugin distribution were installed
    msg = _get_from_yaml(reg, tmp_path, "attention: flash\n", "attention")
    assert msg == (
        "no attention backend named 'flash'. Installed: torch (corerun). "
        "'flash' is provided by corerun-attention-flash: pip install corerun-attention-flash"
    )
    msg = _get_from_yaml(reg, tmp_path, "sampler: basi\n", "sampler")
    assert msg == (
        "no sampler named 'basi'. Installed: full (corerun). Did you mean 'basic'? "
        "'basic' is provided by corerun-sampler-basic: pip install corerun-sampler-basic"
    )
    msg = _get_from_yaml(reg, tmp_path, "sampler: ful\n", "sampler")  # a built-in needs no install
    assert msg == "no sampler named 'ful'. Installed: full (corerun). Did you mean 'full'?"
    monkeypatch.setenv("CORERUN_PLUGINS", "")
    msg = _get_from_yaml(Registry.from_environment(), tmp_path, "sampler: basic\n", "sampler")
    assert "pip install corerun-sampler-basic (and allow it in CORERUN_PLUGINS)" in msg
    assert msg.endswith("CORERUN_PLUGINS= is set: only those plugin ids (and the built-ins) load.")


def test_unknown_name_with_nothing_close(tmp_path: Path) -> None:
    msg = _get_from_yaml(builtins_only(), tmp_path, "attention: {name: xyzzy}\n", "attention")
    assert msg == "no attention backend named 'xyzzy'. Installed: torch (corerun)."


def test_unknown_kind() -> None:
    with pytest.raises(PluginError, match="unknown plugin kind 'scheduler'; kinds are attention, kv_cache, graph, sampler"):
        builtins_only().get("scheduler", "fifo")


# ------------------------------------------------------------------ availability and selection


def test_probe_is_lazy_and_runs_once() -> None:
    calls: list[int] = []

    def probe() -> list[str]:
        calls.append(1)
        return ["libmine is not installed", "needs a CUDA device"]

    reg = builtins_only((Provides(attention=[("mine", Recorder(), {"probe": probe})]), "mine", "corerun-mine"))
    assert calls == []
    mine = reg.get("attention", "mine")
    assert mine.unavailable_reasons() == ["libmine is not installed", "needs a CUDA device"]
    assert not mine.available
    assert calls == [1]
    with pytest.raises(PluginUnavailableError) as err:
        mine.create(spec())
    assert err.value.reasons == ["libmine is not installed", "needs a CUDA device"]
    assert str(err.value) == (
        "attention backend 'mine' is installed but unavailable:\n  - libmine is not installed\n  - needs a CUDA device"
    )


def test_factory_and_probe_are_imported_only_when_used() -> None:
    reg = builtins_only(
        (
            Provides(
                attention=[("ghost", "corerun_no_such_module:Backend", {}), ("spooky", "corerun_no_such:B", {"probe": "corerun_no_such_probe:probe"})]
            ),
            "ghost", "corerun-ghost",
        )
    )
    assert reg.load_errors == []  # registering imported neither the factory nor the probe
    assert reg.get("attention", "ghost").unavailable_reasons() == [  # asking availability imports the factory
        "import of corerun_no_such_module:Backend failed: ModuleNotFoundError: No module named 'corerun_no_such_module'"
    ]
    with pytest.raises(PluginUnavailableError, match="corerun_no_such_module"):
        reg.create("attention", "ghost", spec())
    assert reg.get("attention", "spooky").unavailable_reasons() == [
        "availability probe raised ModuleNotFoundError: No module named 'corerun_no_such_probe'"
    ]


def test_explicit_name_is_never_replaced() -> None:
    plugin = Provides(
        attention=[("mine", Recorder(), {"probe": lambda: ["libmine is not installed"], "capabilities": AttentionCapabilities(head_sizes=frozenset({128})), "priority": 100})]
    )
    reg = builtins_only((plugin, "mine", "corerun-mine"))
    with pytest.raises(PluginUnavailableError) as err:
        reg.select_attention("mine", spec(head_size=64))
    assert err.value.reasons == ["libmine is not installed", "head size 64 not in {128}"]
    assert reg.select_attention("torch", spec()).name == "torch"


def trusted(*plugins: tuple[Any, str, str]) -> Registry:
    """Like :func:`builtins_only`, with the plugins registered as first-party (``auto`` may choose them)."""
    reg = builtins_only()
    for obj, plugin, dist in plugins:
        reg.register_module(obj, plugin=plugin, distribution=dist, version="1.2.3", origin="first-party")
    return reg


def test_auto_picks_the_best_capable_available_backend(caplog: pytest.LogCaptureFixture) -> None:
    plugin = Provides(
        attention=[
            ("fastest", Recorder(), {"priority": 30, "probe": lambda: ["needs a CUDA device"]}),
            ("fast", Recorder(), {"priority": 20, "capabilities": AttentionCapabilities(dtypes=frozenset({"bfloat16"}))}),
            ("good", Recorder(), {"priority": 10, "capabilities": AttentionCapabilities()}),
        ]
    )
    reg = trusted((plugin, "mine", "corerun-mine"))
    with caplog.at_level(logging.INFO, logger="corerun.selection"):
        assert reg.select_attention("auto", spec(torch.float16)).name == "good"
    (record,) = caplog.records  # at the default level: the choice, in one line
    assert record.levelno == logging.INFO and record.name == "corerun.selection"
    assert record.message == (
        "attention: auto chose 'good' from corerun-mine 1.2.3 (first-party, priority 10 on cpu); "
        "passed over torch, fast, fastest (corerun -v says why)"
    )
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="corerun.registry"):  # -v: the reasons
        reg.select_attention("auto", spec(torch.float16))
    (reasons,) = [r.message for r in caplog.records if r.name == "corerun.registry"]
    assert "torch: lower priority (0 < 10)" in reasons
    assert "fastest: needs a CUDA device" in reasons and "fast: dtype float16 not in {bfloat16}" in reasons
    assert reg.select_attention("auto", spec(torch.bfloat16)).name == "fast"


def test_auto_never_picks_an_uncertified_third_party(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A priority-100 third-party backend stays out of ``auto`` until certified for its exact version;
    named explicitly, it is used as asked."""
    monkeypatch.setenv("CORERUN_CACHE_DIR", str(tmp_path))
    from corerun.plugin import trust

    reg = builtins_only((Provides(attention=[("greedy", Recorder(), {"priority": 100})]), "greedy", "corerun-greedy"))
    with caplog.at_level(logging.INFO):
        assert reg.select_attention("auto", spec()).name == "torch"
    assert "greedy: third-party, not certified on cpu (run `corerun conformance attention:greedy`)" in caplog.records[-1].message
    assert caplog.records[-1].name == "corerun.registry"  # the reasons, at -v
    with caplog.at_level(logging.INFO, logger="corerun.selection"):
        assert reg.select_attention("greedy", spec()).name == "greedy"
    assert caplog.records[-1].message == "attention: 'greedy' as configured, from corerun-greedy 1.2.3 (not certified on cpu)"
    greedy = reg.get("attention", "greedy")
    trust.record_certificate(greedy, "cpu", {"passed": 1})
    assert reg.select_attention("auto", spec()).name == "greedy"
    assert greedy.trust_problem("cuda") is not None  # a certificate covers one device type
    greedy.version = "1.2.4"  # another installed version: the certificate no longer covers it
    assert reg.select_attention("auto", spec()).name == "torch"
    assert "certificate is for other code (distribution version 1.2.3 -> 1.2.4)" in greedy.trust_problem("cpu")


def test_priority_may_depend_on_the_device_type() -> None:
    plugin = Provides(
        attention=[
            ("gpu_first", Recorder(), {"priority": {"cuda": 30, "cpu": -10}}),
            ("steady", Recorder(), {"priority": {"default": 5}}),
        ]
    )
    reg = trusted((plugin, "mine", "corerun-mine"))
    assert reg.select_attention("auto", spec(device="cpu")).name == "steady"
    assert reg.get("attention", "gpu_first").priority_on("cuda") == 30
    assert reg.get("attention", "steady").priority_on("cuda") == 5


def test_auto_with_no_capable_backend_lists_every_reason() -> None:
    plugin = Provides(attention=[("gpu_only", Recorder(), {"capabilities": AttentionCapabilities(devices=frozenset({"cuda"}))})])
    reg = builtins_only((plugin, "mine", "corerun-mine"))
    with pytest.raises(PluginUnavailableError) as err:
        reg.select_attention("auto", spec(torch.int8))
    assert sorted(err.value.reasons) == [
        "gpu_only: dtype int8 not in {bfloat16, float16, float32}; device cpu not in {cuda}",
        "torch: dtype int8 not in {bfloat16, float16, float32, float64}",
    ]


def test_options_are_validated_by_the_plugin_schema() -> None:
    plugin = Provides(attention=[("mine", Recorder(), {"options": WindowOptions})], sampler=[("plain", Recorder(), {})])
    reg = builtins_only((plugin, "mine", "corerun-mine"))
    mine = reg.get("attention", "mine")
    assert mine.validate_options({"window": 8}, "attention") == {"window": 8, "causal": True}
    with pytest.raises(PluginError) as err:
        mine.validate_options({"window": "wide"}, "attention")
    assert str(err.value) == (
        "invalid options for attention backend 'mine': attention.options.window: "
        "Input should be a valid integer, unable to parse string as an integer (got 'wide')"
    )
    with pytest.raises(PluginError, match=r"attention\.options\.windw: Extra inputs are not permitted \(got 3\)"):
        mine.validate_options({"windw": 3}, "attention")
    with pytest.raises(PluginError, match=r"sampler: sampler 'plain' takes no options, got \['top_k'\]"):
        reg.get("sampler", "plain").validate_options({"top_k": 3}, "sampler")


def test_get_registry_reads_the_environment_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_module, "_default", None)
    monkeypatch.setenv("CORERUN_PLUGINS", "")
    first = registry_module.get_registry()
    assert registry_module.get_registry() is first
    assert sorted(first.plugins) == ["corerun"]
    monkeypatch.setenv("CORERUN_PLUGINS", "sampler_basic")
    assert sorted(registry_module.get_registry(refresh=True).plugins) == ["corerun", "sampler_basic"]


# ------------------------------------------------------------------ the listing document


def test_listing_document_and_tables(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")
    monkeypatch.delenv("CORERUN_PLUGINS", raising=False)
    empty = Provides()

    class Crashes:
        @hookimpl
        def corerun_samplers(self, register: Any) -> None:
            raise ImportError("no module named libfoo")

    reg = builtins_only((empty, "empty", "corerun-empty"), (Crashes(), "crashes", "corerun-crashes"))
    doc = describe(reg, probe=False)
    assert {"plugin": "empty", "distribution": "corerun-empty", "version": "1.2.3", "provides": []} in doc["plugins"]
    assert doc["load_errors"] == [
        {"plugin": "crashes", "distribution": "corerun-crashes", "error": "hook corerun_samplers raised ImportError: no module named libfoo"}
    ]
    assert [(i["kind"], i["name"]) for i in doc["implementations"]] == [
        ("attention", "torch"), ("kv_cache", "paged"), ("graph", "compile"), ("graph", "cuda"), ("graph", "eager"), ("graph", "replay"),
        ("sampler", "full"),
        ("tool_parser", "hermes"), ("tool_parser", "llama3_json"), ("tool_parser", "mistral"),
        ("reasoning_parser", "deepseek_r1"), ("reasoning_parser", "qwen3"),
        ("model", "Gemma2ForCausalLM"), ("model", "Gemma3ForCausalLM"), ("model", "LlamaForCausalLM"), ("model", "MistralForCausalLM"), ("model", "MixtralForCausalLM"),
        ("model", "Phi3ForCausalLM"), ("model", "Qwen2ForCausalLM"), ("model", "Qwen2MoeForCausalLM"), ("model", "Qwen3ForCausalLM"),
        ("model", "Qwen3MoeForCausalLM"), ("quantization", "awq"), ("quantization", "compressed-tensors"),
        ("quantization", "fp8"), ("quantization", "gguf"), ("quantization", "gptq"), ("quantization", "none"),
        ("lora", "grouped"), ("lora", "torch"), ("fused_ops", "torch"),
        ("executor", "inproc"), ("executor", "launched"), ("executor", "local"), ("executor", "ray"),
    ]
    assert doc["not_loaded"] == []  # CORERUN_PLUGINS is unset: nothing was left out on purpose
    render(doc)
    out = capsys.readouterr().out
    assert "provides nothing" in out and "not checked" in out
    assert "hook corerun_samplers raised ImportError: no module named libfoo" in out
