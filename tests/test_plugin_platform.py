"""The plugin platform as a stranger meets it, with throw-away distributions installed by pip
(tests/helpers/platform_plugins.py): no silent takeover by ``auto``, certificates, built-in names kept,
one-line load failures, the ``CORERUN_PLUGINS`` filter explained, and ``corerun new`` ready to pass.

Everything runs in subprocesses that see the site through ``PYTHONPATH``; certificates go to a
temporary ``CORERUN_CACHE_DIR``.  The engine runs a tiny random Llama (head size 16) on CPU.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from corerun.cli import cli
from corerun.testing.tiny_models import make_tiny_model
from tests.helpers.platform_plugins import ALL
from tests.helpers.thirdparty import Site, check, write_package

# The throw-away plugins and the first-party sampler (`full` is built in); the repository's attention plugins (first-party,
# so `auto` may pick them) stay out, so that `auto` is the built-in until a plugin is certified.
PLUGINS = "narrow,nocausal,lazykernel,badimport,evil,sampler_basic"
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64, 128, 2, 200, 31, 8, 77, 150, 19]  # two blocks of 16 and one token


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("platform")
    site = Site(root / "site")
    site.install([write_package(root / "src", pkg) for pkg in ALL])
    model = make_tiny_model(root, arch="llama", num_key_value_heads=4)  # no GQA: narrow declares none
    return {"site": site, "cache": root / "cache", "model": model}


ENGINE = """
import json, sys
from corerun import LLM, SamplingParams

out = {}
for attention in sys.argv[2:]:
    try:
        llm = LLM(model=sys.argv[1], device="cpu", dtype="float32", attention=attention,
                  kv_cache={"block_size": 16, "num_blocks": 32}, scheduler={"max_model_len": 64})
    except Exception as exc:
        out[attention] = {"error": f"{type(exc).__name__}: {exc}"}
        continue
    (res,) = llm.generate([%s], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    out[attention] = {"chose": llm.engine.runner.attention_name, "tokens": list(res.outputs[0].token_ids)}
print(json.dumps(out))
""" % PROMPT


def engine(world: dict, *attention: str, **env: str) -> tuple[dict, list[str]]:
    """Build an LLM per ``attention`` in one fresh interpreter: results, and the stderr lines corerun printed."""
    done = world["site"].python(
        ENGINE, args=[str(world["model"]), *attention], plugins=PLUGINS, CORERUN_CACHE_DIR=str(world["cache"]), **env
    )
    return json.loads(check(done)), done.stderr.splitlines()


CLI_MANY = """
import json, sys
from click.testing import CliRunner
from corerun.cli import cli

print(json.dumps([CliRunner().invoke(cli, args) for args in json.loads(sys.argv[1])], default=lambda r: [r.exit_code, r.output]))
"""


def corerun(site: Site, *commands: list[str], plugins: str = PLUGINS, **env: str) -> list[tuple[int, str]]:
    """``corerun`` commands run one after the other in one fresh interpreter (one torch import): ``(exit code, output)``."""
    done = site.python(CLI_MANY, args=[json.dumps(commands)], plugins=plugins, COLUMNS="80", **env)
    return [tuple(r) for r in json.loads(check(done))]


def test_auto_takes_only_built_in_or_certified_and_says_so(world: dict) -> None:
    before, said = engine(world, "auto", "torch")
    # a priority-1 backend with no causal mask is installed: auto stays on the built-in, and says why
    assert before["auto"]["chose"] == "torch" and before["auto"]["tokens"] == before["torch"]["tokens"]
    (auto_line,) = [line for line in said if "attention: auto chose" in line]
    assert auto_line.startswith("corerun: attention: auto chose 'torch' from corerun 0.1.0 (built-in, priority 0 on cpu)")
    assert "nocausal" in auto_line.split("passed over ")[1] and auto_line.endswith("(corerun -v says why)")
    assert "corerun: attention: 'torch' as configured, from corerun 0.1.0 (built-in on cpu)" in said

    (code, rejected), (ok, certified) = corerun(
        world["site"], ["conformance", "attention:nocausal", "-k", "prefill and not cached"], ["conformance", "attention:narrow"],
        CORERUN_CACHE_DIR=str(world["cache"]),
    )
    assert code == 1 and "FAILED prefill" in rejected and "not certified: the run did not pass" in rejected, rejected
    assert ok == 0, certified
    assert "certified attention:narrow from corerun-attention-narrow 0.1.0 (wheel RECORD) for corerun 0.1.0, torch " in " ".join(certified.split())
    assert (world["cache"] / "certificates" / "attention-narrow-corerun-attention-narrow-cpu.json").is_file()

    after, said = engine(world, "auto", "nocausal", "lazykernel")
    assert after["auto"] == {"chose": "narrow", "tokens": before["torch"]["tokens"]}
    assert any(line.startswith("corerun: attention: auto chose 'narrow' from corerun-attention-narrow 0.1.0 (certified, priority 5 on cpu)") for line in said)
    # named explicitly, an uncertified backend is used as asked
    assert after["nocausal"]["chose"] == "nocausal"
    assert "corerun: attention: 'nocausal' as configured, from corerun-attention-nocausal 0.1.0 (not certified on cpu)" in said
    # a kernel module imported lazily: one line naming plugin, distribution and the exception
    error = after["lazykernel"]["error"]
    assert error.startswith(
        "PluginLoadError: attention backend 'lazykernel' (plugin 'lazykernel', distribution corerun-attention-lazykernel 0.1.0) "
        "failed to load: ModuleNotFoundError: No module named 'corerun_lazykernel_ext'"
    ) and "\n" not in error


@pytest.fixture(scope="module")
def listing(world: dict) -> dict:
    """``corerun plugins --json``, plus ``conformance``: (exit code, output) of ``conformance attention:lazykernel --json``."""
    (code, text), conformance = corerun(world["site"], ["plugins", "--json"], ["conformance", "attention:lazykernel", "--json"])
    assert code == 0, text
    return {**json.loads(text), "conformance": conformance}


def test_names_stay_with_built_in_and_first_party(listing: dict) -> None:
    """(The engines of the first test, built with the default sampler beside this plugin, show LLM() keeps working.)"""
    impls = {(i["kind"], i["name"]): i for i in listing["implementations"]}
    assert impls[("attention", "torch")]["distribution"] == "corerun"
    assert impls[("sampler", "full")]["distribution"] == "corerun"
    assert impls[("sampler", "evil_extra")]["distribution"] == "corerun-evil"  # the rest of the plugin works
    evil = sorted(e["error"] for e in listing["load_errors"] if e["distribution"] == "corerun-evil")
    assert len(evil) == 2
    assert evil[0].startswith("attention backend name 'torch' belongs to corerun (built-in); the one corerun-evil (plugin 'evil') registers is ignored")
    assert evil[1].startswith("sampler name 'full' belongs to corerun (built-in); the one corerun-evil")
    assert all("pip uninstall corerun-evil" in e for e in evil)
    auto_cpu = next(a for a in listing["auto"] if a["kind"] == "attention" and a["device"] == "cpu")
    why = {p["name"]: p["why"] for p in auto_cpu["passed_over"]}
    assert "badimport" in why and why["nocausal"].startswith("third-party, not certified on cpu")


def test_a_kernel_that_fails_to_import_is_unavailable_with_the_reason(listing: dict) -> None:
    impls = {(i["kind"], i["name"]): i for i in listing["implementations"]}
    bad = impls[("attention", "badimport")]
    assert bad["available"] is False and bad["reasons"] == [
        "import of corerun_attention_badimport.backend:Backend failed: ModuleNotFoundError: No module named 'corerun_badimport_ext'"
    ]
    code, text = listing["conformance"]
    doc = json.loads(text)
    assert code == 1
    (only,) = doc["results"]  # one error, not one per case
    assert only["outcome"] == "error" and "plugin 'lazykernel', distribution corerun-attention-lazykernel" in only["reason"]
    assert "corerun_lazykernel_ext" in only["reason"] and "the remaining checks were not run" in only["reason"]


def test_a_filter_naming_no_plugin_is_explained(world: dict) -> None:
    code = """
        from corerun.plugin.registry import Registry
        try:
            Registry.from_environment().get("attention", "narrow")
        except Exception as exc:
            print(exc)
    """
    done = world["site"].python(code, plugins="narrow_backend,badimport")
    message = check(done).strip()
    warning = "CORERUN_PLUGINS names 'narrow_backend', but no installed plugin has that id; it lists plugin ids (entry-point names), not implementation names."
    assert warning in done.stderr and "Did you mean 'narrow'?" in done.stderr
    assert message.startswith("no attention backend named 'narrow'. Installed: badimport (corerun-attention-badimport), torch (corerun).")
    assert "CORERUN_PLUGINS=narrow_backend,badimport is set: only those plugin ids (and the built-ins) load" in message
    assert "'narrow_backend', but no installed plugin has that id" in message
    ((code, listed),) = corerun(world["site"], ["plugins"], plugins="narrow_backend")
    assert code == 0 and "warning: CORERUN_PLUGINS names 'narrow_backend'" in " ".join(listed.split())


GLUE_FILES = ("pyproject.toml", "{package}/__init__.py", "{package}/plugin.py", "{package}/backend.py", "tests/test_conformance.py")


def test_scaffolded_plugins_pass_conformance_unedited(tmp_path: Path) -> None:
    runner = CliRunner()
    for kind in ("attention", "sampler", "kv_cache", "graph"):
        done = runner.invoke(cli, ["new", kind, "foo", "--dir", str(tmp_path / "src")])
        assert done.exit_code == 0, done.output
    again = runner.invoke(cli, ["new", "attention", "foo", "--dir", str(tmp_path / "src")])
    assert again.exit_code == 2 and "already exists" in again.output
    roots = sorted((tmp_path / "src").iterdir())
    assert [r.name for r in roots] == ["corerun-attention-foo", "corerun-graph-foo", "corerun-kv-cache-foo", "corerun-sampler-foo"]
    site = Site(tmp_path / "site")
    site.install(roots)
    env = {"CORERUN_CACHE_DIR": str(tmp_path / "cache")}
    runs = [
        ["conformance", "attention:foo", "-k", "fp32 and (decode or prefill or kv_write) or unsupported"],
        ["conformance", "kv_cache:foo"],  # the whole suite: certified
        ["conformance", "sampler:foo", "-k", "(distribution and not pair) or seeds or undeclared or declared or greedy or non_finite"],
        ["conformance", "graph:foo", "-k", "fp32 and padding"],
    ]
    for args, (code, output) in zip(runs, corerun(site, *runs, plugins=None, **env)):
        assert code == 0, f"{args}:\n{output}"
    assert (tmp_path / "cache" / "certificates" / "kv_cache-foo-corerun-kv-cache-foo-cpu.json").is_file()
    # the scaffold's own tests run the same suite through pytest
    attention = tmp_path / "src" / "corerun-attention-foo"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(attention / "tests"), "-k", "decode and fp32"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=site.env(**env),
    )
    assert done.returncode == 0 and re.search(r"\d+ passed", done.stdout), done.stdout + done.stderr
    # everything but the kernel is glue, and it is short
    glue = 0
    for rel in GLUE_FILES:
        lines = [line for line in (attention / rel.format(package="corerun_attention_foo")).read_text().splitlines() if line.strip()]
        if rel.endswith("backend.py"):
            lines = lines[: next(i for i, line in enumerate(lines) if "the kernel" in line)]
        glue += len(lines)
    assert glue < 50, glue
