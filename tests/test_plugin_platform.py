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

# The throw-away plugins and the first-party samplers; the repository's attention plugins (first-party,
# so `auto` may pick them) stay out, so that `auto` is the built-in until a plugin is certified.
PLUGINS = "narrow,nocausal,lazykernel,badimport,evil,sampler_full,sampler_basic"
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64, 128, 2, 200, 31, 8, 77, 150, 19]  # two blocks of 16 and one token


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("platform")
    site = Site(root / "site")
    site.install([write_package(root / "src", pkg) for pkg in ALL])
    return {"site": site, "cache": root / "cache", "model": make_tiny_model(root, arch="llama")}


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


def corerun(world: dict, *args: str, plugins: str = PLUGINS) -> subprocess.CompletedProcess[str]:
    return world["site"].corerun(list(args), plugins=plugins, CORERUN_CACHE_DIR=str(world["cache"]), COLUMNS="80")


def test_auto_takes_only_built_in_or_certified_and_says_so(world: dict) -> None:
    before, said = engine(world, "auto", "torch")
    # a priority-1 backend with no causal mask is installed: auto stays on the built-in, and says why
    assert before["auto"]["chose"] == "torch" and before["auto"]["tokens"] == before["torch"]["tokens"]
    (auto_line,) = [line for line in said if "attention: auto chose" in line]
    assert auto_line.startswith("corerun: attention: auto chose 'torch' from corerun 0.1.0 (built-in, priority 0 on cpu)")
    assert "nocausal: third-party, not certified on cpu (run `corerun conformance attention:nocausal`)" in auto_line
    assert "corerun: attention: 'torch' as configured, from corerun 0.1.0 (built-in on cpu)" in said

    rejected = corerun(world, "conformance", "attention:nocausal", "-k", "prefill and not cached and fp32")
    assert rejected.returncode == 1, rejected.stdout + rejected.stderr
    assert "FAILED prefill[" in rejected.stdout and "not certified: the run did not pass" in rejected.stdout

    certified = corerun(world, "conformance", "attention:narrow")
    assert certified.returncode == 0, certified.stdout + certified.stderr
    assert "certified attention:narrow from corerun-attention-narrow 0.1.0 for corerun 0.1.0 on" in " ".join(certified.stdout.split())
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
    return json.loads(check(corerun(world, "plugins", "--json")))


def test_names_stay_with_built_in_and_first_party(world: dict, listing: dict) -> None:
    impls = {(i["kind"], i["name"]): i for i in listing["implementations"]}
    assert impls[("attention", "torch")]["distribution"] == "corerun"
    assert impls[("sampler", "full")]["distribution"] == "corerun-sampler-full"
    assert impls[("sampler", "evil_extra")]["distribution"] == "corerun-evil"  # the rest of the plugin works
    evil = sorted(e["error"] for e in listing["load_errors"] if e["distribution"] == "corerun-evil")
    assert len(evil) == 2
    assert evil[0].startswith("attention backend name 'torch' belongs to corerun (built-in); the one corerun-evil (plugin 'evil') registers is ignored")
    assert evil[1].startswith("sampler name 'full' belongs to corerun-sampler-full (first-party); the one corerun-evil")
    assert all("pip uninstall corerun-evil" in e for e in evil)
    auto_cpu = next(a for a in listing["auto"] if a["kind"] == "attention" and a["device"] == "cpu")
    why = {p["name"]: p["why"] for p in auto_cpu["passed_over"]}
    assert "badimport" in why and why["nocausal"].startswith("third-party, not certified on cpu")
    # the default engine (sampler full, attention auto) still builds
    results, _ = engine(world, "auto")
    assert len(results["auto"]["tokens"]) == 6


def test_a_kernel_that_fails_to_import_is_unavailable_with_the_reason(world: dict, listing: dict) -> None:
    impls = {(i["kind"], i["name"]): i for i in listing["implementations"]}
    bad = impls[("attention", "badimport")]
    assert bad["available"] is False and bad["reasons"] == [
        "import of corerun_attention_badimport.backend:Backend failed: ModuleNotFoundError: No module named 'corerun_badimport_ext'"
    ]
    done = corerun(world, "conformance", "attention:lazykernel", "--json")
    doc = json.loads(done.stdout)
    assert done.returncode == 1
    (only,) = doc["results"]  # one error, not one per case
    assert only["outcome"] == "error" and "plugin 'lazykernel', distribution corerun-attention-lazykernel" in only["reason"]
    assert "corerun_lazykernel_ext" in only["reason"] and "the remaining checks were not run" in only["reason"]


def test_a_filter_naming_no_plugin_is_explained(world: dict) -> None:
    code = """
        from corerun.registry import Registry
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
    listed = corerun(world, "plugins", plugins="narrow_backend")
    assert listed.returncode == 0 and "warning: CORERUN_PLUGINS names 'narrow_backend'" in " ".join(listed.stdout.split())


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
    env = {"CORERUN_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "80"}
    runs = {
        "attention:foo": ["-k", "fp32 or unsupported"],
        "kv_cache:foo": [],  # the whole suite: certified
        "sampler:foo": ["-k", "(distribution and not pair) or seeds or undeclared or declared or greedy"],
        "graph:foo": ["-k", "fp32 and padding"],
    }
    for impl, args in runs.items():
        done = site.corerun(["conformance", impl, *args], **env)
        assert done.returncode == 0, f"{impl}:\n{done.stdout}\n{done.stderr}"
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


def test_plugin_tests_use_only_public_corerun_modules() -> None:
    plugins = Path(__file__).resolve().parent.parent / "plugins"
    offenders = [str(p) for p in plugins.glob("*/tests/**/*.py") if re.search(r"^\s*(from|import) tests\b", p.read_text(), re.M)]
    assert offenders == [], offenders
