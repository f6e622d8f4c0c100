"""Third-party plugins, pip installed for real: listed, selectable from YAML, isolated when broken.

One session-wide site (``pip install --target``) holds four throw-away distributions:

- ``corerun-attention-mine`` (plugin ``mine``): the torch reference backend under the name ``mine``,
  with an ``options`` schema and a probe that reports the libraries named in ``$MINE_MISSING``;
- ``corerun-broken`` (plugin ``broken``): its entry point imports a library that is not installed;
- ``corerun-twin-a`` / ``corerun-twin-b``: both register a sampler named ``twin`` (twin-b also ``solo``).

corerun and the repository's own plugins come from the test environment; the subprocesses see the
site through ``PYTHONPATH`` and run the ``corerun`` console script, or the CLI group and the registry
inside a fresh interpreter when the test also inspects what that interpreter imported.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from corerun._version import PROTOCOL_VERSION
from tests.helpers.thirdparty import PluginPackage, Site, check, write_package

MINE = PluginPackage(
    distribution="corerun-attention-mine",
    package="corerun_attention_mine",
    entry_point="mine",
    version="0.4.0",
    modules={
        "plugin": '''
            """Registers ``mine`` (imports no torch)."""
            from pydantic import BaseModel, ConfigDict, Field

            from corerun import AttentionCapabilities, hookimpl


            class MineOptions(BaseModel):
                model_config = ConfigDict(extra="forbid")
                window: int = Field(0, ge=0)


            @hookimpl
            def corerun_attention_backends(register):
                register(
                    "mine",
                    "corerun_attention_mine.backend:MineAttentionBackend",
                    capabilities=AttentionCapabilities(
                        dtypes=frozenset({"float32", "float64"}),
                        block_sizes=frozenset({16, 32}),
                        devices=frozenset({"cpu"}),
                    ),
                    probe="corerun_attention_mine.probe:probe",
                    options=MineOptions,
                    priority=-5,
                    description="the torch reference backend, packaged by a third party",
                )
        ''',
        "probe": '''
            import os


            def probe():
                return [f"{lib} is not installed" for lib in os.environ.get("MINE_MISSING", "").split(",") if lib]
        ''',
        "backend": '''
            from corerun.attention.torch_backend import TorchAttentionBackend


            class MineAttentionBackend(TorchAttentionBackend):
                name = "mine"

                def __init__(self, spec, window=0):
                    super().__init__(spec)
                    self.window = window
        ''',
    },
)
BROKEN = PluginPackage(
    distribution="corerun-broken",
    package="corerun_broken",
    entry_point="broken",
    modules={"plugin": "import corerun_missing_kernel_lib  # a dependency that is not installed\n"},
)


def _twin(letter: str, extra: str = "") -> PluginPackage:
    return PluginPackage(
        distribution=f"corerun-twin-{letter}",
        package=f"corerun_twin_{letter}",
        entry_point=f"twin_{letter}",
        version=f"1.{ord(letter) - ord('a')}.0",
        modules={
            "plugin": f'''
                from corerun import SamplerCapabilities, hookimpl


                @hookimpl
                def corerun_samplers(register):
                    register("twin", "corerun_twin_{letter}.sampler:Sampler", capabilities=SamplerCapabilities(params=frozenset()))
                    {extra}
            '''
        },
    )


TWIN_A = _twin("a")
TWIN_B = _twin("b", 'register("solo", "corerun_twin_b.sampler:Solo")')
BUILTINS = {("attention", "torch"), ("kv_cache", "paged"), ("graph", "eager"), ("graph", "cuda"), ("graph", "compile"), ("graph", "replay"),
            ("sampler", "full")}
# the model layer's built-ins: families, quantization methods, tool-call and reasoning parsers; the executors,
# LoRA kernels and fused ops
MODEL_LAYER_BUILTINS = {
    *(("model", arch) for arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
                                   "MixtralForCausalLM", "Phi3ForCausalLM",
                                   "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")),
    *(("quantization", name) for name in ("none", "gguf", "gptq", "awq", "compressed-tensors", "fp8")),
    ("tool_parser", "hermes"), ("tool_parser", "llama3_json"),
    ("tool_parser", "mistral"), ("reasoning_parser", "deepseek_r1"), ("reasoning_parser", "qwen3"),
    ("executor", "inproc"), ("executor", "local"), ("executor", "launched"), ("executor", "ray"),
    ("lora", "torch"), ("lora", "grouped"), ("fused_ops", "torch"),
}
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    root = tmp_path_factory.mktemp("thirdparty")
    site = Site(root / "site")
    site.install([write_package(root / "src", pkg) for pkg in (MINE, BROKEN, TWIN_A, TWIN_B)])
    return site


SEPARATOR = "=" * 20


@pytest.fixture(scope="module")
def listing(site: Site) -> dict:
    """``corerun plugins --json`` (probes run) and the factory modules it imported; ``table``: ``corerun plugins``.

    One interpreter runs both (the probes import torch, which takes seconds on a busy machine).
    """
    done = site.python(
        f"""
        import json, sys
        from corerun.cli import cli
        from corerun.plugin.registry import get_registry
        cli(["plugins", "--json"], standalone_mode=False)
        factories = sorted({{r.factory.partition(":")[0] for r in get_registry().all() if isinstance(r.factory, str)}})
        print(json.dumps({{"factories_imported": [m for m in factories if m in sys.modules]}}), file=sys.stderr)
        print({SEPARATOR!r})
        cli(["plugins"], standalone_mode=False)
        """
    )
    doc_text, table = check(done).split(SEPARATOR + "\n")
    doc = json.loads(doc_text)
    (line,) = [line for line in done.stderr.splitlines() if line.startswith('{"factories_imported"')]
    doc["factories_imported"] = json.loads(line)["factories_imported"]
    doc["table"] = table
    return doc


def _impls(doc: dict) -> dict[tuple[str, str], dict]:
    return {(i["kind"], i["name"]): i for i in doc["implementations"]}


def _rows(text: str, title: str) -> list[list[str]]:
    """Rows of the rich table printed under ``title``; a multi-line cell comes back joined by newlines."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows: list[list[str]] = []
    for line in lines[start + 1 :]:
        if line.startswith("└"):
            break
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if cells[0] or not rows:
            rows.append(cells)
        else:
            rows[-1] = [f"{a}\n{b}" if b else a for a, b in zip(rows[-1], cells)]
    return rows


def test_third_party_backend_is_listed_in_json(listing: dict) -> None:
    mine = _impls(listing)[("attention", "mine")]
    assert mine == {
        "kind": "attention",
        "name": "mine",
        "plugin": "mine",
        "distribution": "corerun-attention-mine",
        "version": "0.4.0",
        "protocol_version": PROTOCOL_VERSION,  # (declared by default: the version of the corerun it registers with)
        "priority": -5,
        "description": "the torch reference backend, packaged by a third party",
        "origin": "third-party",
        "capabilities": {
            "dtypes": ["float32", "float64"],
            "head_sizes": None,
            "max_head_size": None,
            "block_sizes": [16, 32],
            "devices": ["cpu"],
            "gqa": True,
            "cuda_graph_decode": False,
            "replay_decode": False,
            "emulated_on": [],
            "sliding_window": False,
            "logits_soft_cap": False,
            "kv_cache_dtypes": [],
        },
        "available": True,
        "reasons": [],
    }
    plugins = {p["plugin"]: p for p in listing["plugins"]}
    assert plugins["mine"] == {
        "plugin": "mine", "distribution": "corerun-attention-mine", "version": "0.4.0", "provides": ["attention:mine"]
    }
    # the repository's own plugins and the built-ins are listed beside it
    assert BUILTINS | {("attention", "triton"), ("attention", "flash"), ("sampler", "full"), ("sampler", "basic")} <= set(_impls(listing))
    assert {_impls(listing)[k]["distribution"] for k in BUILTINS} == {"corerun"}


def test_listing_with_probes_imports_each_available_factory(listing: dict) -> None:
    # A factory whose module cannot be imported is unavailable, so the probing listing imports the
    # factory of every implementation its probe passes (never one whose probe failed, like flash here).
    imported = set(listing["factories_imported"])
    assert {"corerun_attention_mine.backend", "corerun.attention.torch_backend", "corerun.sampler.full"} <= imported
    if not HAS_CUDA:
        assert "corerun_attention_flash.backend" not in imported


def test_flash_and_cuda_graphs_unavailable_with_every_reason(listing: dict) -> None:
    flash = _impls(listing)[("attention", "flash")]
    expected = []
    if importlib.util.find_spec("flash_attn") is None and importlib.util.find_spec("flash_attn_interface") is None:
        expected.append("flash-attn is not installed")
    if not HAS_CUDA:
        expected.append("needs a CUDA device")
    for phrase in expected:
        assert any(r.startswith(phrase) for r in flash["reasons"]), (phrase, flash["reasons"])
    assert flash["available"] is (not flash["reasons"])
    if not HAS_CUDA:
        cuda = _impls(listing)[("graph", "cuda")]
        assert cuda["available"] is False and cuda["reasons"]
    for key in BUILTINS - {("graph", "cuda")}:
        assert _impls(listing)[key]["available"] is True, key


def test_broken_plugin_is_reported_and_the_rest_work(listing: dict) -> None:
    errors = [e for e in listing["load_errors"] if e["plugin"] == "broken"]
    assert len(errors) == 1
    assert errors[0]["distribution"] == "corerun-broken"
    assert "ModuleNotFoundError" in errors[0]["error"] and "corerun_missing_kernel_lib" in errors[0]["error"]
    assert "broken" not in {p["plugin"] for p in listing["plugins"]}
    assert ("attention", "mine") in _impls(listing) and ("sampler", "solo") in _impls(listing)


def test_duplicate_name_names_both_distributions(site: Site, listing: dict) -> None:
    assert listing["conflicts"] == [
        {
            "kind": "sampler",
            "name": "twin",
            "registrations": [
                {"plugin": "twin_a", "distribution": "corerun-twin-a", "version": "1.0.0"},
                {"plugin": "twin_b", "distribution": "corerun-twin-b", "version": "1.1.0"},
            ],
        }
    ]
    assert ("sampler", "twin") not in _impls(listing)  # no silent last-wins
    assert [e["error"] for e in listing["load_errors"] if "twin" in e["error"]] == [
        "sampler name 'twin' is registered by both corerun-twin-a (plugin 'twin_a') and corerun-twin-b (plugin 'twin_b'), "
        "so neither is used; remove one: `pip uninstall corerun-twin-a` or `pip uninstall corerun-twin-b` "
        "(or load only one, e.g. CORERUN_PLUGINS=twin_a)"
    ]
    done = site.python(
        """
        from corerun.plugin.registry import get_registry
        print(get_registry().get("sampler", "solo").distribution)
        try:
            get_registry().get("sampler", "twin")
        except Exception as exc:
            print(type(exc).__name__, exc)
        """
    )
    solo, error = check(done).strip().splitlines()
    assert solo == "corerun-twin-b"
    assert error.startswith("PluginError sampler name 'twin' is registered by both corerun-twin-a")
    assert "corerun-twin-b" in error and "CORERUN_PLUGINS" in error


def test_table_lists_plugins_conflicts_and_load_errors(listing: dict) -> None:
    out = listing["table"]
    rows = {(r[3], r[4]): r for r in _rows(out, "Installed implementations")}
    assert rows[("attention", "mine")] == ["mine", "corerun-attention-mine", "0.4.0", "attention", "mine", "third-party", "yes"]
    assert rows[("sampler", "full")][5] == rows[("attention", "torch")][5] == "built-in"
    assert rows[("sampler", "basic")][5] == "first-party"
    assert rows[("attention", "torch")][:3] == ["corerun", "corerun", "0.1.0"]
    flash = rows[("attention", "flash")][6]
    if not HAS_CUDA:
        assert flash.startswith("no\n") and "- needs a CUDA device" in flash
    (conflict,) = _rows(out, "Name conflicts")
    assert conflict[:2] == ["sampler", "twin"]
    assert "corerun-twin-a 1.0.0 (plugin 'twin_a')" in conflict[2] and "corerun-twin-b 1.1.0 (plugin 'twin_b')" in conflict[2]
    broken = [r for r in _rows(out, "Load errors") if r[0] == "broken"]
    assert broken and broken[0][1] == "corerun-broken" and "corerun_missing_kernel_lib" in broken[0][2]


SELECT = """
    import io, json, os, sys
    from contextlib import redirect_stdout

    import torch
    from corerun.cli import cli
    from corerun.config import load_config
    from corerun.errors import PluginUnavailableError
    from corerun.protocols import AttentionSpec
    from corerun.plugin.registry import get_registry


    def select(path, out):
        cfg = load_config(path)
        reg = get_registry(refresh=True)
        spec = AttentionSpec(4, 2, 16, torch.float32, 16, torch.device("cpu"))
        try:
            chosen = reg.select_attention(cfg.attention.name, spec)
        except PluginUnavailableError as exc:
            out["unavailable"] = exc.reasons
            return
        out["chosen"] = [chosen.name, chosen.distribution, chosen.plugin]
        out["imported_before_create"] = "corerun_attention_mine.backend" in sys.modules
        backend = chosen.create(spec, options=cfg.attention.options)
        out["backend"] = [type(backend).__module__, type(backend).__name__, [c.__name__ for c in type(backend).__mro__]]
        out["window"] = backend.window
        out["bytes_per_block"] = backend.kv_cache_bytes_per_block()
        try:
            reg.select_attention(cfg.attention.name, AttentionSpec(4, 2, 16, torch.float16, 64, torch.device("cpu")))
        except PluginUnavailableError as exc:
            out["float16_reasons"] = exc.reasons


    result = {"available": {}, "missing": {}}
    select(sys.argv[1], result["available"])
    os.environ["MINE_MISSING"] = "libmine,libother"  # the probe reads it when it runs
    listing = io.StringIO()
    with redirect_stdout(listing):
        cli(["plugins", "--json"], standalone_mode=False)
    result["missing"]["listing"] = json.loads(listing.getvalue())
    select(sys.argv[1], result["missing"])
    print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def selection(site: Site, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Selection from YAML (``attention: {name: mine, options: {window: 3}}``) in a fresh interpreter:
    ``available`` with the probe passing, ``missing`` with the probe reporting two missing libraries."""
    path = tmp_path_factory.mktemp("yaml") / "corerun.yaml"
    path.write_text("attention:\n  name: mine\n  options: {window: 3}\n")
    return json.loads(check(site.python(SELECT, args=[str(path)])))


def test_yaml_selects_the_installed_backend(selection: dict) -> None:
    out = selection["available"]
    assert out["chosen"] == ["mine", "corerun-attention-mine", "mine"]
    assert out["imported_before_create"] is True  # selecting checks that its factory imports
    module, cls, mro = out["backend"]
    assert (module, cls) == ("corerun_attention_mine.backend", "MineAttentionBackend")
    assert "TorchAttentionBackend" in mro
    assert out["window"] == 3
    # [K and V] x block_size 16 x 2 KV heads x head size 16 x 4 bytes (float32)
    assert out["bytes_per_block"] == 2 * 16 * 2 * 16 * 4
    assert out["float16_reasons"] == ["dtype float16 not in {float32, float64}", "block size 64 not in {16, 32}"]


def test_probe_reasons_are_listed_and_stop_selection(selection: dict) -> None:
    mine = _impls(selection["missing"]["listing"])[("attention", "mine")]
    assert (mine["available"], mine["reasons"]) == (False, ["libmine is not installed", "libother is not installed"])
    assert selection["missing"]["unavailable"] == ["libmine is not installed", "libother is not installed"]
    assert "chosen" not in selection["missing"]


def test_empty_allow_list_loads_builtins_only(site: Site) -> None:
    doc = json.loads(check(site.corerun(["plugins", "--json", "--no-probe"], plugins="")))
    assert doc["allow_list"] == []
    assert [p["plugin"] for p in doc["plugins"]] == ["corerun"]
    assert set(_impls(doc)) == BUILTINS | MODEL_LAYER_BUILTINS
    assert doc["load_errors"] == [] and doc["conflicts"] == []  # the broken plugin and the twins were never imported
    not_loaded = {p["plugin"]: p["distribution"] for p in doc["not_loaded"]}
    assert {"mine": "corerun-attention-mine", "broken": "corerun-broken", "twin_a": "corerun-twin-a"}.items() <= not_loaded.items()
    assert all("available" not in i for i in doc["implementations"])  # --no-probe


def test_allow_list_restricts_loading(site: Site) -> None:
    doc = json.loads(check(site.corerun(["plugins", "--json", "--no-probe"], plugins=" mine, twin_a ")))
    assert doc["allow_list"] == ["mine", "twin_a"]
    assert sorted(p["plugin"] for p in doc["plugins"]) == ["corerun", "mine", "twin_a"]
    assert set(_impls(doc)) == BUILTINS | MODEL_LAYER_BUILTINS | {("attention", "mine"), ("sampler", "twin")}
    assert _impls(doc)[("sampler", "twin")]["distribution"] == "corerun-twin-a"
    assert doc["load_errors"] == [] and doc["conflicts"] == []
    out = check(site.corerun(["plugins", "--no-probe"], plugins="mine,twin_a"))
    assert "CORERUN_PLUGINS=mine,twin_a" in out.splitlines()[0]
    assert "Not loaded (CORERUN_PLUGINS leaves them out):" in out and "broken (corerun-broken)" in out


def test_listing_without_probes_imports_no_torch(site: Site) -> None:
    done = site.python(
        """
        import sys
        from corerun.cli import cli
        cli(["plugins", "--no-probe"], standalone_mode=False)
        cli(["plugins", "--no-probe", "--json"], standalone_mode=False)
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "triton", "flash_attn", "numpy"})
        print("HEAVY", heavy, file=sys.stderr)
        """
    )
    check(done)
    assert done.stderr.strip().splitlines()[-1] == "HEAVY []"
    assert "mine" in done.stdout  # the listing did list the installed plugin
