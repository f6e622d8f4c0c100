"""corerun.sdk, the plugin author's toolkit: the dense KV write, the base attention backend's checks,
seeded generators and capability checks.  (Its reference_attention passes the whole attention suite
in test_plugin_platform.py, as the certified ``narrow`` backend and the scaffolded ``foo``.)"""

from __future__ import annotations

import pytest
import torch

from corerun import AttentionCapabilities, SamplerCapabilities, UnsupportedError
from corerun.protocols.attention import AttentionSpec
from corerun.sampling_params import SamplingParams
from corerun.sdk import require_params, require_spec
from corerun.sdk.attention import DenseAttentionBackend, write_kv
from corerun.sdk.sampling import row_seed, seeded_generator, seeded_rows


def _cache(num_blocks: int = 5, block_size: int = 4, heads: int = 2, head_size: int = 8) -> torch.Tensor:
    return torch.full((2, num_blocks, block_size, heads, head_size), float("nan"))


@pytest.mark.parametrize("slots", [[7, -1, 0, 19, -1, 3], [-1, -1, 12, 5], [4, 9, 2]], ids=["mixed", "padding-first", "all-real"])
def test_write_kv_writes_exactly_the_named_slots(slots: list[int]) -> None:
    g = torch.Generator().manual_seed(len(slots))
    key, value = torch.randn(len(slots), 2, 8, generator=g), torch.randn(len(slots), 2, 8, generator=g)
    cache = _cache()
    write_kv(key, value, cache, torch.tensor(slots))
    flat = cache.view(2, 20, 2, 8)
    written = {s for s in slots if s >= 0}
    for row, slot in enumerate(slots):
        if slot >= 0:
            assert torch.equal(flat[0, slot], key[row]) and torch.equal(flat[1, slot], value[row])
    untouched = [s for s in range(20) if s not in written]
    assert flat[:, untouched].isnan().all()  # nothing else was written, padding rows included


def test_write_kv_with_only_padding_changes_nothing() -> None:
    cache = _cache()
    cache[0, 0, 0] = 3.0  # slot 0 holds a value: rewriting it with itself must keep it
    before = cache.clone()
    write_kv(torch.randn(3, 2, 8), torch.randn(3, 2, 8), cache, torch.tensor([-1, -1, -1]))
    assert torch.equal(cache.isnan(), before.isnan()) and torch.equal(cache.nan_to_num(), before.nan_to_num())


def test_write_kv_refuses_mismatched_rows() -> None:
    with pytest.raises(ValueError, match=r"need one row per slot_mapping entry \(3\)"):
        write_kv(torch.randn(2, 2, 8), torch.randn(2, 2, 8), _cache(), torch.tensor([0, 1, 2]))


def test_base_backend_refuses_what_it_does_not_declare() -> None:
    class Mine(DenseAttentionBackend):
        name = "mine"
        capabilities = AttentionCapabilities(dtypes=frozenset({"float16"}), block_sizes=frozenset({16}), devices=frozenset({"cuda"}))

    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32, block_size=8, device=torch.device("cpu"))
    with pytest.raises(UnsupportedError) as err:
        Mine(spec)
    assert err.value.reasons == ["dtype float32 not in {float16}", "block size 8 not in {16}", "device cpu not in {cuda}"]
    assert str(err.value).startswith("attention backend 'mine': ")
    with pytest.raises(UnsupportedError):
        require_spec("x", Mine.capabilities, spec)


def test_require_params_names_each_undeclared_field() -> None:
    caps = SamplerCapabilities(params=frozenset({"temperature"}))
    require_params("sampler 's'", caps, SamplingParams(temperature=0.5, max_tokens=3))  # engine fields are fine
    with pytest.raises(UnsupportedError) as err:
        require_params("sampler 's'", caps, SamplingParams(top_k=5, seed=3))
    assert err.value.reasons == ["seed=3 is not supported", "top_k=5 is not supported"]


def test_seeded_generator_depends_on_seed_and_step_only() -> None:
    draw = lambda seed, step: torch.rand(6, generator=seeded_generator(seed, step))  # noqa: E731
    assert torch.equal(draw(7, 2), draw(7, 2))
    assert not torch.equal(draw(7, 2), draw(7, 3)) and not torch.equal(draw(7, 2), draw(8, 2))
    assert torch.equal(draw(7, 2), torch.rand(6, generator=torch.Generator().manual_seed(row_seed(7, 2))))
    reused = torch.Generator()
    assert seeded_generator(7, 2, generator=reused) is reused and torch.equal(torch.rand(6, generator=reused), draw(7, 2))
    params = [SamplingParams(seed=1), SamplingParams(), SamplingParams(seed=9)]
    assert seeded_rows(params, [[4, 5], [1], []]) == [(0, 1, 2), (2, 9, 0)]
