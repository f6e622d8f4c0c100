"""Throw-away corerun plugin distributions, written to a temporary folder and installed with pip.

They are installed with ``pip install --target <site>``, never into the running environment: a
subprocess that puts ``<site>`` on ``PYTHONPATH`` sees them as installed distributions (their
``corerun`` entry points included), every other process does not.

    site = Site(tmp_path / "site")
    site.install([write_package(tmp_path / "src", PluginPackage(...))])
    site.corerun(["plugins", "--json"])          # the real `corerun` console script
    site.python("import corerun; ...")           # any code, in a fresh interpreter
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence


@dataclass
class PluginPackage:
    """A pip distribution exposing one entry point in the ``corerun`` group."""

    distribution: str  # "corerun-attention-mine"
    package: str  # "corerun_attention_mine"
    entry_point: str  # the plugin id, e.g. "mine"
    modules: dict[str, str]  # module name inside the package ("plugin") -> source
    version: str = "0.1.0"
    entry_module: str = "plugin"  # the module the entry point names
    extra_files: dict[str, str] = field(default_factory=dict)


def write_package(root: Path, pkg: PluginPackage) -> Path:
    """Write ``pkg`` as a setuptools project under ``root/<distribution>``; returns that folder."""
    src = root / pkg.distribution
    (src / pkg.package).mkdir(parents=True, exist_ok=True)
    (src / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [build-system]
            requires = ["setuptools>=61"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "{pkg.distribution}"
            version = "{pkg.version}"
            requires-python = ">=3.10"
            dependencies = ["corerun"]

            [project.entry-points.corerun]
            {pkg.entry_point} = "{pkg.package}.{pkg.entry_module}"

            [tool.setuptools]
            packages = ["{pkg.package}"]
            """
        )
    )
    (src / pkg.package / "__init__.py").write_text(f'"""{pkg.distribution}, a corerun plugin."""\n')
    for module, source in pkg.modules.items():
        (src / pkg.package / f"{module}.py").write_text(textwrap.dedent(source))
    for rel, text in pkg.extra_files.items():
        (src / rel).write_text(text)
    return src


class Site:
    """A folder that ``pip install --target`` fills, used through ``PYTHONPATH`` by subprocesses."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.mkdir(parents=True, exist_ok=True)

    def install(self, projects: list[Path], timeout: float = 120.0) -> None:
        """``pip install --no-deps --no-build-isolation --no-index --target <site> <projects...>`` (offline)."""
        cmd = [
            sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-input",
            "--no-index", "--no-deps", "--no-build-isolation", "--target", str(self.path), *map(str, projects),
        ]
        env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"pip install failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")

    def env(self, plugins: str | None = None, **extra: str) -> dict[str, str]:
        """The environment of a subprocess that sees this site; ``plugins`` sets ``CORERUN_PLUGINS``."""
        env = {k: v for k, v in os.environ.items() if k != "CORERUN_PLUGINS"}
        env["PYTHONPATH"] = os.pathsep.join([str(self.path), *filter(None, [os.environ.get("PYTHONPATH")])])
        env["COLUMNS"] = "300"  # rich tables: one line per row, easy to search
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        if plugins is not None:
            env["CORERUN_PLUGINS"] = plugins
        env.update(extra)
        return env

    def corerun(self, args: list[str], plugins: str | None = None, timeout: float = 120.0, **extra: str) -> subprocess.CompletedProcess[str]:
        """Run the installed ``corerun`` console script (falls back to ``python -c`` on the CLI group)."""
        script = shutil.which("corerun", path=str(Path(sys.executable).parent))
        cmd = [script] if script else [sys.executable, "-c", "from corerun.cli import main; main()"]
        return subprocess.run(cmd + args, capture_output=True, text=True, timeout=timeout, env=self.env(plugins, **extra))

    def python(
        self, code: str, args: Sequence[str] = (), plugins: str | None = None, timeout: float = 120.0, **extra: str
    ) -> subprocess.CompletedProcess[str]:
        """Run ``code`` (with ``sys.argv[1:] == args``) in a fresh interpreter that sees this site."""
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=timeout,
            env=self.env(plugins, **extra),
        )


def check(done: subprocess.CompletedProcess[str]) -> str:
    """``done.stdout``, or an assertion error showing the command's whole output."""
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done.stdout
