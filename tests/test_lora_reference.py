"""The ``torch`` LoRA kernel against the merged-weights product in float64."""

from __future__ import annotations

import pytest
import torch

from corerun.lora.reference import TorchLoRAKernel
from corerun.lora.tokens import LoRATokens
from corerun.protocols.lora import LoRAKernel, LoRAKernelCapabilities, LoRANeed


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h_in, slices, num_slots, max_rank, ranks = 12, (8, 4, 4), 3, 6, (6, 2, 4)
    w = [torch.randn(out, h_in, generator=g, dtype=torch.float64) for out in slices]
    a = [torch.zeros(num_slots, max_rank, h_in, dtype=torch.float64) for _ in slices]
    b = [torch.zeros(num_slots, out, max_rank, dtype=torch.float64) for out in slices]
    for s, r in enumerate(ranks):  # adapters of smaller rank zero-padded
        for i, out in enumerate(slices):
            a[i][s, :r] = torch.randn(r, h_in, generator=g, dtype=torch.float64)
            b[i][s, :, :r] = torch.randn(out, r, generator=g, dtype=torch.float64)
    scalings = torch.tensor([16 / 6, 0.5, 8 / 4 ** 0.5], dtype=torch.float32)
    return w, a, b, scalings, slices


def test_torch_kernel_equals_merged_weights_per_token():
    w, a, b, scalings, slices = _case()
    token_slots = torch.tensor([2, -1, 0, 1, 1, -1, 0, 2], dtype=torch.int32)
    x = torch.randn(len(token_slots), 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.cat([x @ w_i.T for w_i in w], dim=1)
    base = y.clone()
    TorchLoRAKernel().add_lora(y, x, a, b, scalings, LoRATokens.of(token_slots, num_slots=3), slices)
    for t, s in enumerate(token_slots.tolist()):
        if s < 0:
            assert torch.equal(y[t], base[t])  # untouched, bit for bit
            continue
        merged = torch.cat([w_i + float(scalings[s]) * (b_i[s] @ a_i[s]) for w_i, a_i, b_i in zip(w, a, b)])
        torch.testing.assert_close(y[t], x[t] @ merged.T, rtol=1e-10, atol=1e-10)


def test_torch_kernel_is_a_lora_kernel_and_declares_graph_safety():
    kernel = TorchLoRAKernel()
    assert isinstance(kernel, LoRAKernel)
    assert kernel.capabilities.graph_safe
    assert kernel.capabilities.fits(LoRANeed(device="cpu", dtype="float32", graphs=True)) == []
    narrow = LoRAKernelCapabilities(devices=frozenset({"cuda"}), dtypes=frozenset({"float16"}), max_rank=8, max_slots=2)
    reasons = narrow.fits(LoRANeed(device="cpu", dtype="float32", max_rank=16, max_slots=4, graphs=True))
    assert len(reasons) == 5 and "max_lora_rank 16" in reasons[2] and "max_loras 4" in reasons[3]
    with pytest.raises(TypeError, match="takes no options"):
        TorchLoRAKernel(block=4)


def test_step_bookkeeping_orders_counts_and_resets_the_rows_a_shorter_step_leaves():
    """LoRATokens against Python's own stable sort and counts; a shorter step's leftover rows are -1,
    a slot outside the slots is refused by value."""
    g = torch.Generator().manual_seed(2)
    tokens = LoRATokens(num_slots=3, max_tokens=20, device="cpu")
    for n in (17, 6, 0, 11):
        slots = torch.randint(-1, 3, (n,), generator=g, dtype=torch.int32)
        tokens.update(slots)
        values = slots.tolist()
        want = sorted(range(n), key=lambda t: values[t])  # stable: token order within a slot
        assert tokens.order[:n].tolist() == want and tokens.num_tokens == n
        counts = [values.count(s) for s in range(3)]
        assert tokens.counts.tolist() == counts and list(tokens.host_counts) == counts
        assert tokens.num_base == values.count(-1)
        assert tokens.starts.tolist() == [values.count(-1) + sum(counts[:s]) for s in range(3)]
        assert tokens.slots[:n].tolist() == values and set(tokens.slots[n:].tolist()) <= {-1}
    with pytest.raises(ValueError, match=r"token slots must lie in -1 \.\. 2 \(the LoRA slots\), got -1 \.\. 3"):
        tokens.update(torch.tensor([0, 3, -1], dtype=torch.int32))
    with pytest.raises(ValueError, match="a step of 21 tokens, beyond the 20"):
        tokens.update(torch.zeros(21, dtype=torch.int32))


@pytest.mark.parametrize("kernel", ["torch", "grouped"])
def test_padding_rows_past_the_steps_tokens_are_left_alone(kernel):
    """A CUDA graph's bucket runs more rows than the step has tokens: those rows get no adapter."""
    from corerun.lora.grouped import GroupedLoRAKernel

    w, a, b, scalings, slices = _case(3)
    step = torch.tensor([1, 0, 2, 0, -1], dtype=torch.int32)
    tokens = LoRATokens(num_slots=3, max_tokens=8, device="cpu")
    tokens.update(torch.full((8,), 1, dtype=torch.int32))  # an earlier, longer step
    tokens.update(step)
    x = torch.randn(8, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(4))  # 3 padding rows
    y = torch.cat([x @ w_i.T for w_i in w], dim=1)
    base = y.clone()
    {"torch": TorchLoRAKernel, "grouped": GroupedLoRAKernel}[kernel]().add_lora(y, x, a, b, scalings, tokens, slices)
    assert torch.equal(y[5:], base[5:]) and torch.equal(y[4], base[4])
    for t, s in enumerate(step.tolist()[:4]):
        merged = torch.cat([w_i + float(scalings[s]) * (b_i[s] @ a_i[s]) for w_i, a_i, b_i in zip(w, a, b)])
        torch.testing.assert_close(y[t], x[t] @ merged.T, rtol=1e-10, atol=1e-10)


def test_grouped_reads_the_scalings_once_per_step_and_again_after_the_next_update():
    """Every layer call of a step uses the scalings read at the step's first call (one host read, not
    one per layer); the next step (an adapter changed its slot's scaling) reads them again."""
    from corerun.lora.grouped import GroupedLoRAKernel

    w, a, b, scalings, slices = _case(5)
    reads = []
    read = scalings.tolist
    scalings.tolist = lambda: reads.append(1) or read()
    step = torch.tensor([2, 0, -1, 1, 0, 2], dtype=torch.int32)
    tokens = LoRATokens(num_slots=3, max_tokens=6, device="cpu")
    x = torch.randn(6, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    kernel = GroupedLoRAKernel()
    for new_scaling in (None, 3.25):
        if new_scaling is not None:
            scalings[1] = new_scaling  # set between steps, as LoRAManager.activate does
        tokens.update(step)
        for _ in range(3):  # three layers of one step
            y = torch.cat([x @ w_i.T for w_i in w], dim=1)
            kernel.add_lora(y, x, a, b, scalings, tokens, slices)
            for t, s in enumerate(step.tolist()):
                merged = torch.cat(w) if s < 0 else torch.cat(
                    [w_i + float(scalings[s]) * (b_i[s] @ a_i[s]) for w_i, a_i, b_i in zip(w, a, b)])
                torch.testing.assert_close(y[t], x[t] @ merged.T, rtol=1e-10, atol=1e-10)
        assert len(reads) == (1 if new_scaling is None else 2)
