"""The YAML configuration: defaults, strict keys, error messages, overrides, and ``{name, options}`` choices."""

from __future__ import annotations

from pathlib import Path

import pytest

from corerun.config import Choice, Config, load_config, parse_set
from corerun.errors import ConfigError, PluginError
from corerun.plugin.registry import Registry

# The configuration of the design document, verbatim: every value there is a default.
DESIGN_YAML = """\
model: path/to/hf-model-dir      # config.json + *.safetensors + tokenizer; omitted: the built-in default model
dtype: auto                      # auto | float32 | float16 | bfloat16
device: auto                     # auto | cpu | cuda
attention: auto                  # an installed attention backend
sampler: full                    # an installed sampler
kv_cache: {manager: paged, block_size: 16, num_blocks: auto, memory_fraction: 0.9, prefix_caching: true}
graph: {runner: auto, max_batch_size: 256}
scheduler: {max_num_seqs: 256, max_num_batched_tokens: auto, max_model_len: auto}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "corerun.yaml"
    path.write_text(text)
    return path


def error_of(tmp_path: Path, text: str = "", **kwargs: object) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text) if text else None, **kwargs)  # type: ignore[arg-type]
    assert isinstance(err.value, ValueError)
    return str(err.value)


def _pick(actual: object, like: object) -> object:
    """``actual`` restricted to the keys of ``like``, recursively (the design names a subset of the fields)."""
    if isinstance(like, dict) and like and isinstance(actual, dict):
        return {k: _pick(actual.get(k), v) for k, v in like.items()}
    return actual


def test_the_token_budget_auto_is_vllms_offline_default_for_the_device() -> None:
    sc = Config().scheduler
    assert (sc.token_budget("cpu"), sc.token_budget("cuda"), sc.token_budget("mps")) == (4096, 8192, 8192)
    assert Config(scheduler={"max_num_batched_tokens": 16}).scheduler.token_budget("cpu") == 16
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"max_num_batched_tokens must be >= 1 or 'auto', got {bad}"):
            Config(scheduler={"max_num_batched_tokens": bad})


def test_the_cpu_token_budget_auto_is_1024_in_float32_only() -> None:
    sc = Config().scheduler
    assert [sc.token_budget("cpu", d) for d in ("float32", "bfloat16", "float16")] == [1024, 4096, 4096]
    assert sc.token_budget("cuda", "float32") == 8192
    assert Config(scheduler={"max_num_batched_tokens": 4096}).scheduler.token_budget("cpu", "float32") == 4096


def test_a_float32_cpu_runner_takes_the_float32_budget(tmp_path) -> None:
    from corerun.runner.model_runner import ModelRunner
    from tests.helpers.tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path)
    for dtype, budget in (("float32", 1024), ("bfloat16", 4096)):
        runner = ModelRunner(Config(model=str(model_dir), device="cpu", dtype=dtype, attention="torch",
                                    kv_cache={"num_blocks": 64}, graph={"warmup": False}))
        assert runner.max_num_batched_tokens == budget


def test_defaults_are_the_design_values(tmp_path: Path) -> None:
    expected = {
        "model": None,
        "dtype": "auto",
        "device": "auto",
        "attention": {"name": "auto", "options": {}},
        "sampler": {"name": "full", "options": {}},
        "kv_cache": {"manager": {"name": "paged", "options": {}}, "block_size": 16, "num_blocks": "auto", "memory_fraction": 0.9, "prefix_caching": True},
        "graph": {"runner": {"name": "auto", "options": {}}, "max_batch_size": 256},
        "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": "auto", "max_model_len": "auto"},
    }
    for cfg in (Config(), load_config(), load_config(write(tmp_path, ""))):
        assert _pick(cfg.model_dump(), expected) == expected
    assert load_config(write(tmp_path, DESIGN_YAML)).model_dump(exclude={"model"}) == Config().model_dump(exclude={"model"})
    assert load_config(write(tmp_path, DESIGN_YAML)).model == "path/to/hf-model-dir"


def test_yaml_values_are_read(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "dtype: bfloat16\nattention: triton\nkv_cache:\n  block_size: 32\n  num_blocks: 100\n"))
    assert (cfg.dtype, cfg.attention, cfg.kv_cache.block_size, cfg.kv_cache.num_blocks) == ("bfloat16", Choice(name="triton"), 32, 100)
    assert cfg.kv_cache.memory_fraction == 0.9  # untouched siblings keep their defaults


# ------------------------------------------------------------------ unknown keys


def test_unknown_top_level_key_is_named(tmp_path: Path) -> None:
    msg = error_of(tmp_path, "atention: triton\n")
    assert msg.startswith(f"invalid configuration in {tmp_path / 'corerun.yaml'}:\n")
    assert "  atention: unknown key (did you mean 'attention'? allowed here: model, dtype, device, attention," in msg


def test_unknown_nested_key_is_named(tmp_path: Path) -> None:
    msg = error_of(tmp_path, "kv_cache:\n  blok_size: 32\n")
    assert msg.splitlines()[1] == (
        "  kv_cache.blok_size: unknown key (did you mean 'block_size'? allowed here: manager, block_size, "
        "num_blocks, memory_fraction, prefix_caching, cpu_memory_gb, dtype, k_scale, v_scale)"
    )
    msg = error_of(tmp_path, "attention: {name: triton, option: {}}\n")
    assert "  attention.option: unknown key (did you mean 'options'? allowed here: name, options)" in msg
    msg = error_of(tmp_path, "graph: {runner: {name: cuda, opts: {}}, max_batch: 8}\n")
    assert "graph.runner.opts: unknown key" in msg and "graph.max_batch: unknown key (did you mean 'max_batch_size'?" in msg


# ------------------------------------------------------------------ wrong values


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("kv_cache: {block_size: big}\n", "kv_cache.block_size: Input should be a valid integer, unable to parse string as an integer (got 'big')"),
        ("dtype: float8\n", "dtype: Input should be 'auto', 'float32', 'float16' or 'bfloat16' (got 'float8')"),
        ("kv_cache: {block_size: 24}\n", "kv_cache.block_size: block_size must be a power of two (8, 16, 32, ...), got 24"),
        ("kv_cache: {num_blocks: 0}\n", "kv_cache.num_blocks: num_blocks must be >= 1 or 'auto', got 0"),
        ("kv_cache: {memory_fraction: 1.5}\n", "kv_cache.memory_fraction: Input should be less than or equal to 1 (got 1.5)"),
        ("scheduler: {max_num_seqs: 0}\n", "scheduler.max_num_seqs: Input should be greater than or equal to 1 (got 0)"),
        ("attention: 3\n", "attention: must be an implementation name or {name: ..., options: {...}}, got 3"),
        ("attention: {name: '  '}\n", "attention.name: must be a non-empty implementation name (got '  ')"),
        ("kv_cache: 5\n", "kv_cache: Input should be a valid dictionary or instance of KVCacheConfig (got 5)"),
    ],
)
def test_wrong_value_names_the_field_and_the_value(tmp_path: Path, text: str, line: str) -> None:
    assert error_of(tmp_path, text).splitlines()[1:] == [f"  {line}"]


def test_int_or_auto_field_gives_one_line(tmp_path: Path) -> None:
    lines = error_of(tmp_path, "kv_cache: {num_blocks: many}\n").splitlines()[1:]
    assert lines == [
        "  kv_cache.num_blocks: Input should be a valid integer, unable to parse string as an integer; "
        "or Input should be 'auto' (got 'many')"
    ]


def test_every_error_is_reported_at_once(tmp_path: Path) -> None:
    lines = error_of(tmp_path, "dtype: half\nkv_cache: {blok_size: 8, block_size: 3}\nseed: x\n").splitlines()[1:]
    assert [line.split(":")[0].strip() for line in lines] == ["kv_cache.blok_size", "dtype", "kv_cache.block_size", "seed"]


# ------------------------------------------------------------------ the file itself


def test_malformed_yaml_is_a_clear_error(tmp_path: Path) -> None:
    msg = error_of(tmp_path, "attention: [triton\nsampler: full\n")
    assert msg.startswith(f"config file {tmp_path / 'corerun.yaml'} is not valid YAML: ")
    assert "line" in msg and "column" in msg


def test_yaml_that_is_not_a_mapping(tmp_path: Path) -> None:
    assert error_of(tmp_path, "- attention\n- triton\n") == (
        f"config file {tmp_path / 'corerun.yaml'} must hold a mapping of keys, got list"
    )


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file .*nope.yaml does not exist"):
        load_config(tmp_path / "nope.yaml")


# ------------------------------------------------------------------ overrides


def test_parse_set_builds_nested_values() -> None:
    assert parse_set(["kv_cache.block_size=32", "attention=triton", "kv_cache.prefix_caching=false", "kv_cache.memory_fraction=0.5", "model="]) == {
        "kv_cache": {"block_size": 32, "prefix_caching": False, "memory_fraction": 0.5},
        "attention": "triton",
        "model": "",
    }


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["kv_cache.block_size"], "--set expects KEY=VALUE (e.g. kv_cache.block_size=32), got 'kv_cache.block_size'"),
        (["=3"], "--set expects KEY=VALUE"),
        (["kv_cache=5", "kv_cache.block_size=32"], "--set 'kv_cache.block_size=32': kv_cache was already set to a value"),
    ],
)
def test_parse_set_errors(items: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_set(items)
    assert str(err.value).startswith(message)


def test_yaml_keywords_and_set_merge_in_that_order(tmp_path: Path) -> None:
    path = write(tmp_path, "dtype: float16\nkv_cache: {block_size: 8, num_blocks: 64}\nscheduler: {max_num_seqs: 4}\n")
    cfg = load_config(
        path,
        overrides={"kv_cache": {"block_size": 32}, "scheduler": {"max_num_seqs": 8}, "attention": None},
        sets=["scheduler.max_num_seqs=16", "kv_cache.prefix_caching=false"],
    )
    assert cfg.dtype == "float16"  # YAML
    assert (cfg.kv_cache.block_size, cfg.kv_cache.num_blocks) == (32, 64)  # keyword override merged into the YAML mapping
    assert cfg.scheduler.max_num_seqs == 16  # --set wins over both
    assert cfg.kv_cache.prefix_caching is False
    assert cfg.attention == Choice(name="auto")  # a None keyword means "not given"


def test_override_errors_name_where_the_value_came_from(tmp_path: Path) -> None:
    msg = error_of(tmp_path, sets=["kv_cache.blok_size=32"])
    assert msg.startswith("invalid configuration in defaults + --set:\n  kv_cache.blok_size: unknown key (did you mean 'block_size'?")
    msg = error_of(tmp_path, "dtype: float16\n", overrides={"dtype": "fp8"})
    assert msg.startswith(f"invalid configuration in {tmp_path / 'corerun.yaml'} + keyword overrides:\n  dtype:")
    assert "(got 'fp8')" in msg


# ------------------------------------------------------------------ {name, options}


def test_choice_is_a_name_or_a_mapping(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "attention: {name: triton, options: {num_splits: 4}}\nsampler: basic\nkv_cache: {manager: paged}\n"))
    assert cfg.attention == Choice(name="triton", options={"num_splits": 4})
    assert cfg.sampler == Choice(name="basic", options={})
    assert cfg.kv_cache.manager == Choice(name="paged")


def test_options_merge_onto_a_name_given_as_a_string(tmp_path: Path) -> None:
    path = write(tmp_path, "attention: mine\n")
    assert load_config(path, sets=["attention.options.window=8"]).attention == Choice(name="mine", options={"window": 8})
    assert load_config(path, overrides={"attention": {"options": {"window": 2}}}).attention == Choice(name="mine", options={"window": 2})
    both = write(tmp_path, "attention: {name: mine, options: {window: 1}}\n")
    assert load_config(both, sets=["attention.options.causal=false"]).attention.options == {"window": 1, "causal": False}
    # naming another backend drops the options written for the first one
    assert load_config(both, sets=["attention=torch"]).attention == Choice(name="torch")


def test_options_are_validated_by_the_plugin_schema(tmp_path: Path) -> None:
    reg = Registry.from_environment(allow=[])  # full is built in

    def options(text: str) -> dict:
        cfg = load_config(write(tmp_path, text))
        return reg.get("sampler", cfg.sampler.name).validate_options(cfg.sampler.options, "sampler")

    assert options("sampler: {name: full, options: {logprobs_mode: processed}}\n") == {"logprobs_mode": "processed"}
    assert options("sampler: full\n") == {}
    with pytest.raises(PluginError) as err:
        options("sampler: {name: full, options: {logprobs_mode: processd}}\n")
    assert str(err.value) == (
        "invalid options for sampler 'full': sampler.options.logprobs_mode: Input should be 'raw' or 'processed' (got 'processd')"
    )
    with pytest.raises(PluginError, match=r"sampler\.options\.logprob_mode: Extra inputs are not permitted \(got 'raw'\)"):
        options("sampler: {name: full, options: {logprob_mode: raw}}\n")
    with pytest.raises(PluginError, match=r"kv_cache: KV-cache manager 'paged' takes no options, got \['eviction'\]"):
        cfg = load_config(write(tmp_path, "kv_cache: {manager: {name: paged, options: {eviction: lru}}}\n"))
        reg.get("kv_cache", cfg.kv_cache.manager.name).validate_options(cfg.kv_cache.manager.options, "kv_cache")
