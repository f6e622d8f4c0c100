"""``num_blocks_for_budget``: the CPU budget, and the CUDA arithmetic with torch.cuda's memory queries faked."""

from __future__ import annotations

import pytest
import torch

from corerun.errors import ConfigError
from corerun.kv_cache.sizing import num_blocks_for_budget

MiB, GiB = 1 << 20, 1 << 30
CPU = torch.device("cpu")


def test_cpu_budget_is_cpu_memory_gb() -> None:
    kw = dict(device=CPU, memory_fraction=0.9)  # memory_fraction plays no part on CPU
    assert num_blocks_for_budget(MiB, cpu_memory_gb=0.5, **kw) == 512
    assert num_blocks_for_budget(MiB, cpu_memory_gb=0.5, reserved_bytes=100 * MiB, **kw) == 412
    assert num_blocks_for_budget(3 * MiB, cpu_memory_gb=1.0, **kw) == 341  # 1024 / 3 rounded down
    assert num_blocks_for_budget(MiB, cpu_memory_gb=1 / 1024, **kw) == 1


def test_cpu_budget_too_small_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"cpu_memory_gb=0\.001.*2097152 bytes"):
        num_blocks_for_budget(2 * MiB, device=CPU, memory_fraction=0.9, cpu_memory_gb=0.001)
    with pytest.raises(ConfigError, match="holds no block"):
        num_blocks_for_budget(MiB, device=CPU, memory_fraction=0.9, cpu_memory_gb=1.0, reserved_bytes=2 * GiB)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """80 GiB device, 60 GiB free; torch holds 12 GiB in its pool of which 10 GiB are allocated."""
    seen: list[object] = []

    def mem_get_info(device: object = None) -> tuple[int, int]:
        seen.append(device)
        return 60 * GiB, 80 * GiB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 12 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 * GiB)
    return seen


def test_cuda_budget_arithmetic(fake_cuda: list[object]) -> None:
    dev = torch.device("cuda", 0)
    # in use and not reusable: (80 - 60) - (12 - 10) = 18 GiB; budget 0.9 * 80 - 18 = 54 GiB
    assert num_blocks_for_budget(2 * MiB, device=dev, memory_fraction=0.9, cpu_memory_gb=1.0) == 54 * 512
    assert fake_cuda == [dev]
    # minus 1 GiB reserved by the caller: 53 GiB
    n = num_blocks_for_budget(2 * MiB, device=dev, memory_fraction=0.9, cpu_memory_gb=1.0, reserved_bytes=GiB)
    assert n == 53 * 512
    # 0.5 * 80 - 18 = 22 GiB, in 3 GiB blocks: 7
    assert num_blocks_for_budget(3 * GiB, device=dev, memory_fraction=0.5, cpu_memory_gb=1.0) == 7


def test_cuda_budget_too_small_is_a_config_error(fake_cuda: list[object]) -> None:
    dev = torch.device("cuda")
    with pytest.raises(ConfigError, match="memory_fraction"):  # 0.2 * 80 = 16 GiB < 18 GiB in use
        num_blocks_for_budget(MiB, device=dev, memory_fraction=0.2, cpu_memory_gb=64.0)
    with pytest.raises(ConfigError, match="holds no block"):  # 1 GiB left, blocks of 2 GiB
        num_blocks_for_budget(2 * GiB, device=dev, memory_fraction=19 / 80, cpu_memory_gb=64.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(bytes_per_block=0), "bytes_per_block must be >= 1, got 0"),
        (dict(memory_fraction=0.0), r"memory_fraction must be in \(0, 1\], got 0.0"),
        (dict(memory_fraction=1.5), r"memory_fraction must be in \(0, 1\], got 1.5"),
        (dict(cpu_memory_gb=0.0), "cpu_memory_gb must be > 0, got 0.0"),
        (dict(reserved_bytes=-1), "reserved_bytes must be >= 0, got -1"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    args = dict(bytes_per_block=MiB, device=CPU, memory_fraction=0.9, cpu_memory_gb=1.0) | kwargs
    with pytest.raises(ConfigError, match=message):
        num_blocks_for_budget(args.pop("bytes_per_block"), **args)
