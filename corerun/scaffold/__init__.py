"""``corerun new KIND NAME``: a ready pip distribution for a new plugin, from the templates in
``templates/common`` (pyproject, README, tests) and ``templates/KIND`` (the hook and the implementation).

A template file is written with ``{{placeholder}}`` replaced (see :func:`placeholders`); ``.tmpl`` is
dropped from its name and ``__package__`` in a path becomes the package name.
"""

from __future__ import annotations

import re
from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"
KINDS = {  # kind: (title, conformance suite, YAML that selects NAME)
    "attention": ("attention backend", "AttentionBackendSuite", "attention: {name}"),
    "sampler": ("sampler", "SamplerSuite", "sampler: {name}"),
    "kv_cache": ("KV-cache manager", "KVCacheManagerSuite", "kv_cache: {{manager: {name}}}"),
    "graph": ("graph runner", "GraphRunnerSuite", "graph: {{runner: {name}}}"),
    "logits_processor": ("logits processor", "LogitsProcessorSuite", ""),  # chosen by the fields it serves
    "tool_parser": ("tool-call parser", "ToolParserSuite", ""),  # chosen by `corerun serve --tool-call-parser`
    "reasoning_parser": ("reasoning parser", "ReasoningParserSuite", ""),  # by `--reasoning-parser`
    "model": ("model family", "ModelSuite", ""),  # chosen by `architectures` in a model folder's config.json
    "quantization": ("quantization method", "QuantizationSuite", "quantization: {name}"),
    "lora": ("LoRA kernel", "LoRAKernelSuite", "lora: {{kernel: {name}}}"),
    "executor": ("executor", "ExecutorSuite", "distributed: {{executor: {name}}}"),
    "fused_ops": ("fused ops", "FusedOpsSuite", "fused_ops: {name}"),
}
SERVE_OPTION = {"tool_parser": "--tool-call-parser", "reasoning_parser": "--reasoning-parser"}
NAME = re.compile(r"[a-z][a-z0-9_]*\Z")


def architecture(name: str) -> str:
    """The ``architectures`` name a model family ``name`` registers: ``my_llama`` -> ``MyLlamaForCausalLM``."""
    return "".join(part.capitalize() for part in name.split("_") if part) + "ForCausalLM"


def placeholders(kind: str, name: str) -> dict[str, str]:
    title, suite, yaml = KINDS[kind]
    registered = architecture(name) if kind == "model" else name  # what `corerun conformance KIND:...` names
    return {
        "name": name,
        "registered": registered,
        "kind": kind,
        "title": title,
        "suite": suite,
        "yaml": yaml.format(name=name),
        "select": f"Select it with `{yaml.format(name=name)}` in the YAML config." if yaml else (
            f"Serve with it: `corerun serve {SERVE_OPTION[kind]} {name}`." if kind in SERVE_OPTION else
            f"A model folder whose `config.json` lists `{registered}` in `architectures` runs with it "
            f"(`corerun serve --model FOLDER`)." if kind == "model" else
            "Requests that set a field it serves (`structured_outputs`) use it once it is certified "
            "(and has the highest priority among those serving that field)."),
        "plugin_id": f"{kind}_{name}",
        "package": f"corerun_{kind}_{name}",
        "distribution": f"corerun-{kind.replace('_', '-')}-{name.replace('_', '-')}",
    }


def render(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\{\{(\w+)\}\}", lambda m: values[m.group(1)], text)


def scaffold(kind: str, name: str, parent: Path) -> Path:
    """Write the distribution for ``kind``/``name`` into ``parent/<distribution>``; returns that folder.

    Raises ``ValueError`` for an unknown kind, a name that is not a lowercase identifier, or a folder
    that already exists (nothing is overwritten)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not NAME.match(name):
        raise ValueError(f"NAME must be a lowercase identifier (letters, digits, _; a letter first), got {name!r}")
    values = placeholders(kind, name)
    root = parent / values["distribution"]
    if root.exists():
        raise ValueError(f"{root} already exists; choose another NAME or folder")
    for base in (TEMPLATES / "common", TEMPLATES / kind):
        for src in sorted(p for p in base.rglob("*") if p.is_file()):
            rel = str(src.relative_to(base)).replace("__package__", values["package"]).removesuffix(".tmpl")
            dest = root / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(render(src.read_text(), values))
    return root
