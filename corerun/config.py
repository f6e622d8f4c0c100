"""The configuration: one pydantic model, loaded from YAML, every field defaulted, unknown keys rejected.

The same keys work as keyword overrides in Python (``LLM(attention="triton", kv_cache={"block_size": 32})``)
and on the command line (``--set kv_cache.block_size=32``).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from corerun.errors import ConfigError


# YAML (config files, --set values, plugin options) is read with limits: aliases (``*a``) can nest so
# that a few hundred bytes expand to gigabytes, and a deep nesting can exhaust the parser's stack.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_VALUES = 100_000  # scalars + containers after alias expansion
MAX_CONFIG_DEPTH = 32
MAX_INT = 2**63 - 1  # an integer knob above this overflows the int64 it ends up in


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, v: Any, info: ValidationInfo) -> Any:
        """``block_size: true`` is a mistake, not 1: refuse a boolean where a number is expected."""
        if isinstance(v, bool) and "bool" not in str(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, got the boolean {v!r}")
        return v


class Choice(_Strict):
    """An implementation picked by name, with options its plugin validates (``{name: triton, options: {...}}``)."""

    name: str
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, v: Any) -> Any:
        if isinstance(v, str):
            return {"name": v}
        if not isinstance(v, (Mapping, Choice)):
            raise ValueError(f"must be an implementation name or {{name: ..., options: {{...}}}}, got {v!r}")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must be a non-empty implementation name")
        return v.strip()


class KVCacheConfig(_Strict):
    manager: Choice = Choice(name="paged")
    block_size: int = Field(16, ge=1, le=2**16)
    num_blocks: int | Literal["auto"] = "auto"
    memory_fraction: float = Field(0.9, gt=0.0, le=1.0)
    prefix_caching: bool = True
    cpu_memory_gb: float = Field(2.0, gt=0.0, le=2.0**40)  # the KV budget on CPU when num_blocks is auto
    # how K/V are stored (docs/kv-cache.md): auto (the model's dtype), fp8_e4m3 / fp8_e5m2 (value / k_scale or
    # v_scale, per tensor) or int8 (a scale per token and head, set on write); the attention backend must support it
    dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2", "int8"] = "auto"
    k_scale: float = Field(1.0, gt=0.0, allow_inf_nan=False)  # fp8 only: K is stored as K / k_scale
    v_scale: float = Field(1.0, gt=0.0, allow_inf_nan=False)

    @field_validator("block_size")
    @classmethod
    def _pow2(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"block_size must be a power of two (8, 16, 32, ...), got {v}")
        return v

    @field_validator("num_blocks")
    @classmethod
    def _blocks(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"num_blocks must be >= 1 or 'auto', got {v}")
        if isinstance(v, int) and v > 2**31 - 1:  # block ids are int32 in the block tables
            raise ValueError(f"num_blocks must be at most {2**31 - 1} (block ids are int32) or 'auto', got {v}")
        return v


class GraphConfig(_Strict):
    runner: Choice = Choice(name="auto")
    max_batch_size: int = Field(256, ge=1)
    warmup: bool = True  # CPU, bfloat16/float16: a dummy prefill of the token budget at load (docs/graphs.md, "Warm-up")


class SchedulerConfig(_Strict):
    max_num_seqs: int = Field(256, ge=1)
    # the step's token budget; auto: vLLM's offline defaults, 4096 on CPU (better than 8192 there in throughput
    # and time to first token alike), 8192 on any other device; 1024 for float32 on CPU, whose products are several
    # times slower than bfloat16's (same throughput, TTFT 1.2-1.3x shorter: benchmarks/RESULTS.md, "The float32 token budget")
    max_num_batched_tokens: int | Literal["auto"] = "auto"
    max_model_len: int | Literal["auto"] = "auto"
    chunked_prefill: bool = True
    # schedule step N+1 while step N runs (forward and sampling on a background thread); outputs are
    # identical to synchronous scheduling (docs/usage.md, "Asynchronous scheduling")
    async_scheduling: bool = False

    def token_budget(self, device_type: str, dtype: str | None = None) -> int:
        """``max_num_batched_tokens``, with ``auto`` resolved for a device of type ``device_type`` running
        activations of ``dtype`` (``"float32"``, ``"bfloat16"``, ...; None: not known)."""
        v = self.max_num_batched_tokens
        return v if v != "auto" else 8192 if device_type != "cpu" else 1024 if dtype == "float32" else 4096

    @field_validator("max_model_len", "max_num_batched_tokens")
    @classmethod
    def _len(cls, v: int | str, info: ValidationInfo) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"{info.field_name} must be >= 1 or 'auto', got {v}")
        if info.field_name == "max_model_len" and isinstance(v, int) and v > 2**31 - 1:  # positions are int32
            raise ValueError(f"max_model_len must be at most {2**31 - 1} (positions are int32) or 'auto', got {v}")
        return v


class SpeculativeConfig(_Strict):
    """Speculative decoding (corerun.spec_decode, docs/speculative-decoding.md); off unless ``method`` is set."""

    # ngram: prompt lookup over the request's own tokens; draft_model: a smaller model's greedy tokens
    method: Literal["ngram", "draft_model"] | None = None
    num_tokens: int = Field(4, ge=1, le=64)  # draft tokens proposed per decode step (K)
    prompt_lookup_min: int = Field(2, ge=1)  # ngram: shortest suffix n-gram looked up (1: more drafts, more rejected)
    prompt_lookup_max: int = Field(4, ge=1)  # ngram: longest suffix n-gram looked up (tried first)
    model: str | None = None  # draft_model: the draft's model folder (the target's tokenizer and vocabulary)

    @model_validator(mode="after")
    def _lookup(self) -> "SpeculativeConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method == "draft_model" and (self.model is None or not self.model.strip()):
            raise ValueError(
                f"speculative.model is {self.model!r}; method 'draft_model' needs the draft's model folder "
                "(a smaller model with the target's tokenizer and vocabulary)"
            )
        if self.model is not None and self.method != "draft_model":
            raise ValueError(
                f"speculative.model ({self.model!r}) is used only with method 'draft_model', "
                f"got method {self.method!r}; set method: draft_model or leave model out"
            )
        return self


class DistributedConfig(_Strict):
    """Where the ranks of ``tensor_parallel_size x pipeline_parallel_size`` run and how they find each other
    (docs/executors.md)."""

    # the executor that starts and drives the ranks: auto (inproc for one rank, launched when init_method is
    # set, else local), inproc, local, launched, or an executor plugin's name
    executor: str = "auto"
    executor_options: dict[str, Any] = {}  # the executor's own options (its factory's keyword arguments)
    # layers per pipeline stage, in order (e.g. [3, 5]); None: an even split, the first stages one more
    pipeline_layers: list[int] | None = None
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl on CUDA, gloo on CPU
    # None: one host, the engine starts ranks 1..N-1 itself on a free local port.  "env://" (torchrun:
    # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) or "tcp://host:port": every rank is launched on its host.
    init_method: str | None = None
    timeout_s: float = Field(600.0, gt=0.0)  # a collective waiting longer than this fails
    # every rank started and its model and KV cache built within this (a busy host starts slowly); None: timeout_s
    start_timeout_s: float | None = Field(None, gt=0.0)
    start_method: Literal["spawn", "forkserver"] = "spawn"  # how one host starts its workers (forkserver: faster restarts)

    @field_validator("executor")
    @classmethod
    def _executor(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("executor is empty: give auto, inproc, local, launched or an executor plugin's name")
        return v

    @field_validator("pipeline_layers")
    @classmethod
    def _pipeline_layers(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or min(v) < 1):
            raise ValueError(f"pipeline_layers must list at least one layer for every stage, got {v}")
        return v

    @field_validator("init_method")
    @classmethod
    def _init_method(cls, v: str | None) -> str | None:
        if v is not None and not (v == "env://" or v.startswith("tcp://")):
            raise ValueError(f"init_method must be null (one host), 'env://' or 'tcp://HOST:PORT', got {v!r}")
        return v


class LoRAConfig(_Strict):
    """Multi-LoRA serving (corerun.lora, docs/lora.md): requests name a PEFT adapter, mixed in one batch."""

    enabled: bool = False  # build the slots and the adapters' layers (corerun serve --lora-modules turns it on)
    kernel: Choice = Choice(name="auto")  # the batched LoRA product (a `lora` plugin); auto: the best that fits
    max_loras: int = Field(4, ge=1, le=1024)  # device slots: adapters in one batch at most
    max_lora_rank: int = Field(16, ge=1, le=1024)  # every slot's rank; an adapter of a higher rank is refused at load
    max_cpu_loras: int | None = Field(None, ge=1)  # adapters kept in host memory (LRU); None: max_loras


class ServerConfig(_Strict):
    """``corerun serve`` (corerun.server): the OpenAI-compatible HTTP server on top of the engine."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    served_model_name: str | None = None  # the name clients ask for; None: the model folder's name
    max_waiting_requests: int = Field(256, ge=0)  # more requests waiting than this: 503 at once
    max_request_bytes: int = Field(8 * 2**20, ge=1)  # a larger body: 413
    shutdown_timeout_s: float = Field(30.0, ge=0.0)  # on SIGTERM/SIGINT, in-flight requests then get cut off
    api_key: str | None = None  # every /v1 route needs "Authorization: Bearer <key>" (CLI: --api-key, CORERUN_API_KEY)
    allowed_origins: list[str] = []  # browser origins allowed to call the server ("*": any); others get 403
    allowed_hosts: list[str] = []  # Host names accepted besides the address a request arrived on ("*": any)
    max_connections: int = Field(1000, ge=1)  # open connections beyond this get a 503 and are closed
    read_timeout_s: float = Field(30.0, gt=0.0)  # a request's headers, then its body, must arrive within this
    chat_template_timeout_s: float = Field(5.0, gt=0.0)  # rendering one chat template may take this long
    chat_template_max_chars: int = Field(4 * 2**20, ge=1)  # a rendered chat (and any string in it) may be this long
    tool_call_parser: str = "auto"  # reads tool calls (docs/tool-calling.md); auto: from the chat template; none
    reasoning_parser: str | None = None  # splits the thinking into reasoning_content (deepseek_r1, qwen3, ...)
    lora_modules: dict[str, str] = {}  # adapter name -> PEFT folder, served as models (CLI: --lora-modules name=path)
    enable_lora_runtime_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    data_parallel_size: int = Field(1, ge=1)  # engine replicas, each in its own process (docs/serving.md)

    @field_validator("api_key")
    @classmethod
    def _key(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("api_key is empty: give a key, or leave it out (null) to serve without one")
        return v


class Config(_Strict):
    """Every knob of an engine. ``Config()`` is a working configuration (the built-in default model)."""

    model: str | None = None  # a Hugging Face model folder or a .gguf file; None: the built-in default model
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    attention: Choice = Choice(name="auto")
    # RMSNorm, SiLU-and-mul and RoPE (a `fused_ops` plugin, docs/fused_ops.md): auto picks the best that fits
    # the model's device and dtype; torch: the layers' own torch code
    fused_ops: Choice = Choice(name="auto")
    sampler: Choice = Choice(name="full")
    kv_cache: KVCacheConfig = KVCacheConfig()
    # how the linear layers' weights are stored (docs/quantization.md): auto picks from the checkpoint;
    # gguf with no model runs the default model from its shipped Q4_1 file
    quantization: Choice = Choice(name="auto")
    graph: GraphConfig = GraphConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    lora: LoRAConfig = LoRAConfig()
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)  # contiguous layer stages, each on its own ranks
    distributed: DistributedConfig = DistributedConfig()
    seed: int = Field(0, ge=-(2**63), le=2**64 - 1)  # what torch.manual_seed accepts
    skip_tokenizer_init: bool = False
    allow_pickle_weights: bool = False  # load pytorch_model.bin through torch.load (unsafe); safetensors otherwise
    max_logprobs: int = Field(20, ge=0)
    threads: int | Literal["auto"] = "auto"  # torch's intra-op CPU threads; auto: the physical cores (corerun.platform.host)
    server: ServerConfig = ServerConfig()

    @field_validator("threads")
    @classmethod
    def _threads(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"threads must be >= 1 or 'auto' (the physical cores), got {v}")
        return v

    @field_validator("model")
    @classmethod
    def _model(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("model is empty: give a model folder, or leave it out (null) for the built-in default model")
        return v

    @model_validator(mode="after")
    def _int_limits(self) -> "Config":
        """Integers beyond int64 (``max_num_batched_tokens: 1e30`` as an int) overflow where they are used."""
        for path, value in _walk_ints(self):
            if abs(value) > MAX_INT and path != "seed":
                raise ValueError(f"{path} is {value}, beyond the largest supported value {MAX_INT}")
        return self


def _walk_ints(model: BaseModel, prefix: str = "") -> Any:
    for name in type(model).model_fields:
        v = getattr(model, name)
        if isinstance(v, BaseModel):
            yield from _walk_ints(v, f"{prefix}{name}.")
        elif isinstance(v, int) and not isinstance(v, bool):
            yield f"{prefix}{name}", v


def _short(value: Any, limit: int = 120) -> str:
    """``repr(value)`` (a string as it is) cut to ``limit`` characters."""
    r = value if isinstance(value, str) else repr(value)
    return r if len(r) <= limit else f"{r[:limit]}... ({len(r)} characters)"


def check_limits(data: Any, source: str) -> None:
    """Refuse a loaded YAML value that expands (aliases) past ``MAX_CONFIG_VALUES`` values or nests
    deeper than ``MAX_CONFIG_DEPTH``: a short ConfigError, never a huge message or an exhausted memory."""
    budget = MAX_CONFIG_VALUES
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        v, depth = stack.pop()
        budget -= 1
        if budget < 0:
            raise ConfigError(
                f"{source}: more than {MAX_CONFIG_VALUES} values once aliases (*name) are expanded; "
                "a configuration this large is a mistake or an alias bomb"
            )
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"{source}: nested more than {MAX_CONFIG_DEPTH} levels deep")
        if isinstance(v, Mapping):
            stack.extend((x, depth + 1) for kv in v.items() for x in kv)
        elif isinstance(v, (list, tuple, set)):
            stack.extend((x, depth + 1) for x in v)


def safe_yaml(text: str | bytes, source: str) -> Any:
    """``yaml.safe_load`` with the limits above; bytes must be UTF-8. Raises ConfigError naming ``source``."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source} is {len(text)} bytes; a configuration is at most {MAX_CONFIG_BYTES} bytes")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{source} is not UTF-8 text (byte {exc.start} is 0x{text[exc.start]:02x}); save it as UTF-8"
            ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML: {_short(str(exc), 600)}") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested more than {MAX_CONFIG_DEPTH} levels deep") from None
    check_limits(data, source)
    return data


def _format_errors(exc: ValidationError, source: str) -> str:
    lines: list[str] = []
    by_loc: dict[str, tuple[list[str], Any]] = {}  # a union (int | "auto") errs once per member: one line per key
    for e in exc.errors():
        if e["type"] == "extra_forbidden":
            path = [str(p) for p in e["loc"]]
            parent = _model_at(Config, path[:-1])
            allowed = list(parent.model_fields) if parent else []
            close = difflib.get_close_matches(path[-1], allowed, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            lines.append(f"  {'.'.join(path)}: unknown key ({hint}allowed here: {', '.join(allowed) or '?'})")
        else:
            by_loc.setdefault(_field_path(e["loc"]), ([], e.get("input")))[0].append(e["msg"].removeprefix("Value error, "))
    for loc, (msgs, value) in by_loc.items():
        text = "; or ".join(msgs)
        got = "" if "got " in text or not loc else f" (got {_short(repr(value))})"
        lines.append(f"  {loc or 'configuration'}: {_short(text, 600)}{got}")
    return f"invalid configuration in {source}:\n" + "\n".join(lines)


def _field_path(loc: tuple[Any, ...]) -> str:
    """The config keys of a pydantic error location, without union-member tags like ``int`` or ``literal['auto']``."""
    model: type[BaseModel] | None = Config
    keys: list[str] = []
    for part in loc:
        if model is None or part not in model.model_fields:
            break
        keys.append(str(part))
        model = _model_at(model, [str(part)])
    return ".".join(keys) or ".".join(map(str, loc))


def _model_at(model: type[BaseModel], path: list[str]) -> type[BaseModel] | None:
    for part in path:
        field = model.model_fields.get(part)
        ann = getattr(field, "annotation", None) if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(dict(out[k]), v)
        elif isinstance(v, Mapping) and isinstance(out.get(k), str) and "name" not in v and k in {"attention", "fused_ops", "sampler", "manager", "runner"}:
            out[k] = {"name": out[k], **v}
        else:
            out[k] = v
    return out


def parse_set(items: Sequence[str]) -> dict[str, Any]:
    """``["kv_cache.block_size=32", "attention=triton"]`` -> a nested dict; values parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects KEY=VALUE (e.g. kv_cache.block_size=32), got {item!r}")
        value = safe_yaml(raw, f"--set {_short(item)}: the value") if raw.strip() else ""
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {p} was already set to a value")
        node[parts[-1]] = value
    return out


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    sets: Sequence[str] = (),
) -> Config:
    """Read YAML at ``path`` (optional), apply keyword ``overrides`` then ``--set`` items, validate."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {source} does not exist")
        size = p.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {source} is {size} bytes; a configuration is at most {MAX_CONFIG_BYTES} bytes")
        loaded = safe_yaml(p.read_bytes(), f"config file {source}")
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {source} must hold a mapping of keys, got {type(loaded).__name__}")
        data = loaded
    if overrides:
        check_limits(overrides, "keyword overrides")
        data = deep_merge(data, {k: v for k, v in overrides.items() if v is not None})
        source += " + keyword overrides" if path else " + keyword overrides"
    if sets:
        data = deep_merge(data, parse_set(sets))
        source += " + --set"
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None
