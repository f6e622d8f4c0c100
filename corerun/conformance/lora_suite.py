"""The LoRA kernel conformance suite: ``add_lora`` against the merged-weights product in float64.

Each case draws random float64 base weights ``W_i`` (one per output slice), adapters ``A_i[s]``,
``B_i[s]`` of ranks at and below ``R`` (zero-padded to ``R``, and a slice one adapter leaves
untargeted all zero), scalings, inputs and a random bias, then rounds what the kernel is handed to
the case's dtype.  ``y`` starts as ``x @ W.T + bias`` (so an in-place add must keep it); the
reference adds to it the merged-weights product less the base one, ``x @ (W + s * B[s] @ A[s]).T -
x @ W.T`` per token's slot ``s``, in float64 from the rounded inputs, within the dtype's tolerances
(:mod:`corerun.conformance.tolerances`).  Rows of slot ``-1`` must come back bit for bit.

Checks, one case per declared dtype (and layout):

- ``mixed``: 13 tokens over every slot and ``-1``, in random order, for one output slice, merged
  q/k/v (unequal slices) and gate/up (equal ones);
- ``base_only``: every token ``-1``: ``y`` unchanged;
- ``one_token``: a single decode token (batch 1);
- ``large``: 70 tokens, 200 input features, slices of 96 and 40 columns, rank up to 16 (token and
  feature counts no tile divides: tiles must mask);
- ``graph_replay`` (``graph_safe`` kernels, on CUDA): captured in a CUDA graph (a host
  synchronisation fails the capture), replayed with other slots and inputs in the same tensors (the
  step's :class:`~corerun.lora.tokens.LoRATokens` refilled in place between replays, as the engine
  does before each step).

The kernel gets the tokens' slots with their order by slot and each slot's count already computed
(:class:`~corerun.lora.tokens.LoRATokens`, once per step in the engine), as the protocol states.

Adopt it with::

    class TestMine(LoRAKernelSuite):
        implementation = "mine"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from corerun.conformance.suite import Case, ConformanceSuite
from corerun.conformance.target import Target
from corerun.conformance.tolerances import SHORT_DTYPE, within
from corerun.lora.tokens import LoRATokens

DTYPES = ("float32", "bfloat16", "float16", "float64")
LAYOUTS = {"one": (24,), "qkv": (32, 8, 8), "gate_up": (24, 24)}


@dataclass(frozen=True)
class LoRACase:
    """One problem: ``tokens`` tokens of ``h_in`` features, output ``slices``, ``slots`` slots of rank ``rank``."""

    dtype: str
    slices: tuple[int, ...]
    tokens: int = 13
    h_in: int = 40
    slots: int = 4
    rank: int = 8


class Problem:
    """Random float64 weights and inputs for a :class:`LoRACase`, and what the kernel is handed (rounded)."""

    def __init__(self, case: LoRACase, device: str, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        f64, dtype = torch.float64, getattr(torch, case.dtype)
        h, r, n = case.h_in, case.rank, case.slots

        def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return torch.randn(*shape, generator=g, dtype=f64) * scale

        ranks = [r, max(1, r // 2), 1, max(1, r - 3)][:n] + [r] * max(0, n - 4)  # at and below R
        self.w = [randn(out, h, scale=h**-0.5) for out in case.slices]
        a = [torch.zeros(n, r, h, dtype=f64) for _ in case.slices]
        b = [torch.zeros(n, out, r, dtype=f64) for out in case.slices]
        for s, rank in enumerate(ranks):
            for i, out in enumerate(case.slices):
                if s == 2 and i == len(case.slices) - 1 and len(case.slices) > 1:
                    continue  # this adapter does not target the last slice: it stays zero
                a[i][s, :rank] = randn(rank, h, scale=h**-0.5)
                b[i][s, :, :rank] = randn(out, rank, scale=rank**-0.5)
        self.scalings = (torch.rand(n, generator=g, dtype=f64) * 1.5 + 0.5).float()  # alpha / r in [0.5, 2)
        self.x = randn(case.tokens, h).to(dtype)
        self.bias = randn(case.tokens, sum(case.slices))
        self.a = [t.to(dtype).to(device) for t in a]
        self.b = [t.to(dtype).to(device) for t in b]
        self.slices = case.slices
        self.dtype, self.device = case.dtype, device

    def inputs(self, token_slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, LoRATokens]:
        """``(y, x, tokens)`` on the device: ``y = x @ W.T + bias`` rounded to the dtype; ``tokens`` the
        step's bookkeeping of ``token_slots`` (their order by slot, each slot's count)."""
        x = self.x[: len(token_slots)]
        y = torch.cat([x.double() @ w.T for w in self.w], 1) + self.bias[: len(token_slots)]
        tokens = LoRATokens(len(self.scalings), max(1, len(token_slots)), self.device)
        tokens.update(torch.tensor(token_slots, dtype=torch.int32))
        return y.to(self.x.dtype).to(self.device), x.to(self.device), tokens

    def reference(self, token_slots: list[int], before: torch.Tensor) -> torch.Tensor:
        """``y`` as handed over plus ``x @ (W + s * B[s] @ A[s]).T - x @ W.T`` per token's slot ``s``, in
        float64 on the CPU (the base output's rounding to the dtype is not the kernel's error)."""
        x64 = self.x[: len(token_slots)].double()
        a = [t.cpu().double() for t in self.a]
        b = [t.cpu().double() for t in self.b]
        base = torch.cat(self.w)
        merged = {-1: base}
        for s in set(token_slots) - {-1}:
            merged[s] = torch.cat([w + float(self.scalings[s]) * (b_i[s] @ a_i[s]) for w, a_i, b_i in zip(self.w, a, b)])
        rows = [merged[s] @ x64[t] - base @ x64[t] for t, s in enumerate(token_slots)]
        return before.detach().cpu().double() + torch.stack(rows)

    def run(self, kernel: Any, token_slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's ``y`` after ``add_lora``, and ``y`` as it was handed over."""
        y, x, tokens = self.inputs(token_slots)
        before = y.clone()
        out = kernel.add_lora(y, x, self.a, self.b, self.scalings.to(self.device), tokens, self.slices)
        if out is not None and out is not y:
            raise AssertionError(f"add_lora returned a {type(out).__name__}; it must add into y in place and return None")
        return y, before


def check(what: str, problem: Problem, token_slots: list[int], got: torch.Tensor, before: torch.Tensor) -> None:
    """``got`` within the dtype's tolerances of the merged-weights reference; rows of slot -1 unchanged."""
    if got.shape != before.shape or got.dtype != before.dtype:
        raise AssertionError(f"{what}: y changed shape or dtype to {tuple(got.shape)} {got.dtype}")
    base = [t for t, s in enumerate(token_slots) if s < 0]
    moved = [t for t in base if not torch.equal(got[t], before[t])]
    if moved:
        raise AssertionError(f"{what}: tokens {moved} have slot -1 (the base model) but their rows of y changed")
    ref = problem.reference(token_slots, before)
    ok, how = within(problem.dtype, got, ref)
    if not ok:
        err = (got.detach().cpu().double() - ref).abs()
        t, col = divmod(int(err.argmax()), err.shape[1])
        raise AssertionError(f"{what}: y off the float64 merged-weights product: {how}; worst at token {t} "
                             f"(slot {token_slots[t]}) column {col}: got {got[t, col].item():.6g}, "
                             f"expected {ref[t, col].item():.6g}")


def mixed_slots(tokens: int, slots: int, seed: int) -> list[int]:
    """``tokens`` slots in random order covering ``-1`` and every slot (each at least twice when it fits)."""
    g = torch.Generator().manual_seed(seed)
    cover = [s for s in range(-1, slots)] * 2
    rest = torch.randint(-1, slots, (max(0, tokens - len(cover)),), generator=g).tolist()
    chosen = (cover + rest)[:tokens]
    return [chosen[i] for i in torch.randperm(len(chosen), generator=g).tolist()]


class LoRAKernelSuite(ConformanceSuite):
    """The LoRA kernel conformance suite (see the module docstring)."""

    kind = "lora"

    def configs(self, check: str, target: Target, full: bool) -> list[tuple[str, Any]] | str:
        caps = target.capabilities
        dtypes = [d for d in DTYPES if d in caps.dtypes]
        if not dtypes:
            return f"{target.label} declares none of the dtypes {', '.join(DTYPES)}"
        slots = min(4, caps.max_slots or 4)
        rank = min(8, caps.max_rank or 8)
        if check == "mixed":
            return [(f"{SHORT_DTYPE[d]}-{name}", LoRACase(d, sizes, slots=slots, rank=rank))
                    for d in dtypes for name, sizes in LAYOUTS.items()]
        if check == "large":
            big = min(16, caps.max_rank or 16)
            return [(SHORT_DTYPE[d], LoRACase(d, (96, 40), tokens=70, h_in=200, slots=slots, rank=big)) for d in dtypes]
        if check == "graph_replay" and not caps.graph_safe:
            return f"{target.label} does not declare graph_safe"
        return [(SHORT_DTYPE[d], LoRACase(d, LAYOUTS["qkv"], slots=slots, rank=rank)) for d in dtypes]

    def _kernel(self, case: Case) -> Any:
        self.start(case)
        return case.target.create()

    def _mixed(self, case: Case, seed: int) -> None:
        kernel = self._kernel(case)
        problem = Problem(case.config, case.device, seed=seed)
        token_slots = mixed_slots(case.config.tokens, case.config.slots, seed=seed + 1)
        check(f"{case.id}, slots {token_slots}", problem, token_slots, *problem.run(kernel, token_slots))

    def test_mixed(self, case: Case) -> None:
        self._mixed(case, seed=1)

    def test_base_only(self, case: Case) -> None:
        kernel = self._kernel(case)
        problem = Problem(case.config, case.device, seed=3)
        token_slots = [-1] * case.config.tokens
        check(f"{case.id}, every token slot -1", problem, token_slots, *problem.run(kernel, token_slots))

    def test_one_token(self, case: Case) -> None:
        kernel = self._kernel(case)
        problem = Problem(case.config, case.device, seed=4)
        token_slots = [case.config.slots - 1]
        check(f"{case.id}, one token in slot {token_slots[0]}", problem, token_slots, *problem.run(kernel, token_slots))

    def test_large(self, case: Case) -> None:
        self._mixed(case, seed=5)

    def test_graph_replay(self, case: Case) -> None:
        import pytest

        kernel = self._kernel(case)
        if not case.device.startswith("cuda"):
            pytest.skip("graph_replay captures a CUDA graph: it runs on a CUDA device")
        problem = Problem(case.config, case.device, seed=7)
        first = mixed_slots(case.config.tokens, case.config.slots, seed=8)
        y, x, tokens = problem.inputs(first)
        scalings = problem.scalings.to(case.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (compilation, autotuning) outside the capture
            kernel.add_lora(y.clone(), x, problem.a, problem.b, scalings, tokens, problem.slices)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                kernel.add_lora(y, x, problem.a, problem.b, scalings, tokens, problem.slices)
        except RuntimeError as exc:
            raise AssertionError(f"{case.id}: add_lora cannot be captured in a CUDA graph (a host synchronisation "
                                 f"or an allocation that depends on the slots?): {exc}") from exc
        for seed in (9, 10):  # other slots, other inputs, in the captured tensors
            token_slots = mixed_slots(case.config.tokens, case.config.slots, seed=seed)
            problem.x = torch.randn(problem.x.shape, generator=torch.Generator().manual_seed(seed)).to(problem.x.dtype)
            y_new, x_new, _ = problem.inputs(token_slots)
            y.copy_(y_new)
            x.copy_(x_new)
            tokens.update(torch.tensor(token_slots, dtype=torch.int32))  # the step's bookkeeping, outside the graph
            graph.replay()
            torch.cuda.synchronize()
            check(f"{case.id}, replay with slots {token_slots}", problem, token_slots, y, y_new)
