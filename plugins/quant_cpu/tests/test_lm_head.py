"""The LM head of a GGUF file whose head tensor is packed (the default model's tied ``token_embd``,
Q8_0) goes through the kernel: logits against float64 from the ``gguf`` package's own decoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from corerun_quant_cpu import kernels  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_default_model_logits_through_the_kernel() -> None:
    from corerun.sdk.quantization import find_default_gguf
    from corerun.testing.tiny_models import load_corerun_model

    from corerun_quant_cpu.method import GGUFCpuMethod

    path = find_default_gguf()
    method = GGUFCpuMethod()
    model, config = load_corerun_model(path, quant=method)
    head = model.lm_head.quantized
    assert head is not None and head.gguf_types == {None: "Q8_0"}, "the tied Q8_0 head should go through the kernel"
    (t,) = [t for t in gguf.GGUFReader(str(path)).tensors if t.name == "token_embd.weight"]
    w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64))  # [vocab, hidden]
    assert tuple(w.shape) == (config.vocab_size, config.hidden_size)
    hidden = torch.randn(3, config.hidden_size, generator=torch.Generator().manual_seed(31))
    want = hidden.double() @ w.T
    for isa in kernels.runnable_isas():  # every path this CPU runs, the method's choice forced
        method.isa = isa
        with torch.no_grad():
            logits = model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and tuple(logits.shape) == (3, config.vocab_size)
        err = (logits.double() - want).abs()
        bound = 8 * hidden.shape[1] ** 0.5 * torch.finfo(torch.float32).eps * (hidden.double().abs() @ w.abs().T)
        if isa == "avx512":  # int8 activations per 32-block: + half a step times |W| (see test_kernels' _act_bound)
            step = hidden.double().reshape(3, -1, 32).abs().amax(-1, keepdim=True).expand(3, -1, 32).reshape(3, -1) / 254
            bound = 2 * bound + step @ w.abs().T
        assert (err <= bound).all(), f"{isa}: {(err / bound).max().item():.3g}x the bound"
        assert (logits.argmax(1) == want.argmax(1)).all(), isa
