"""``ModelSuite``: every model family (a ``model`` plugin) must pass it.

The reference is Hugging Face transformers' own implementation of the architecture, in float64:
each case is a tiny random configuration built with the architecture's transformers config class
(GQA, MHA and MQA; tied and untied embeddings), whose weights are handed to the family as a
checkpoint.  The family runs in float64 through corerun's ``torch`` attention backend, with a
scrambled paged KV cache filled with NaN (a read of a block it was not given poisons the logits).

- ``weights``: the checkpoint loads with nothing missing or unexpected; with one tensor removed and
  one added, the error names both.
- ``prefill``: logits of one prompt equal transformers'.
- ``chunked_prefill``: the prompt in three chunks, then two decode steps, equal transformers'.
- ``prefix_decode``: a second request reuses the first's cached blocks (a prefix hit), prefills the
  rest in the same step as the first request decodes; every row equals transformers'.
- ``greedy``: 8 tokens decoded greedily one step at a time equal transformers' greedy tokens.
- ``preemption``: a request decodes, is preempted (its blocks handed to another request, which
  overwrites them), is recomputed from its prompt and outputs in fresh blocks over two chunks, and
  decodes on; every row after the resumption equals transformers'.
- ``tensor_parallel`` (families declaring ``tensor_parallel``; with ``--full-matrix`` only, it starts
  two processes): the family split over two gloo ranks gives the logits of a chunked prefill and
  decodes the single-process family gives (:mod:`corerun.conformance.model_parallel`).

The checkpoint is what transformers' ``save_pretrained`` writes (experts one tensor each, as on the Hub).
The architecture transformers builds is the class's ``hf_architecture`` when it has one, else the
registered name; a family adds configuration keys its tiny configs need (expert counts,
window sizes) as a class attribute ``conformance_config: dict``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from corerun.conformance.suite import Case, ConformanceSuite
from corerun.conformance.target import Target

TOLERANCE = 1e-6  # normwise relative error: the model runs in float64, compute_logits returns float32
BLOCK_SIZE = 4

SHAPES: dict[str, dict[str, Any]] = {  # case id -> transformers config keys
    "gqa-untied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mha-tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "mqa-untied": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False),
}
FULL_SHAPES: dict[str, dict[str, Any]] = {
    "gqa-tied-3layers": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, num_hidden_layers=3),
}
BASE: dict[str, Any] = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=128,
                            max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)


@dataclass(frozen=True)
class ModelCase:
    architecture: str
    config: dict[str, Any]  # transformers config keys


def _fail(message: str) -> None:
    pytest.fail(message, pytrace=False)


def architecture(target: Target) -> str:
    """The transformers class the family is compared with: the class's ``hf_architecture`` when it names one
    (a new family built on a known one, say), else the registered architecture."""
    return str(getattr(target.implementation_class(), "hf_architecture", None) or target.name)


class ModelSuite(ConformanceSuite):
    """Subclass with ``implementation = "MyForCausalLM"`` (a registered architecture), or
    ``factory = MyForCausalLM`` with ``hf_architecture`` on the class::

        class TestMine(ModelSuite):
            implementation = "MyForCausalLM"
    """

    kind = "model"

    def pick_device(self, target: Target) -> str:
        return "cpu"  # the float64 reference runs on CPU

    def configs(self, check: str, target: Target, full: bool) -> list[tuple[str, Any]] | str:
        arch = architecture(target)
        extra = dict(getattr(target.implementation_class(), "conformance_config", {}) or {})
        if check == "tensor_parallel":
            if not getattr(target.capabilities, "tensor_parallel", False):
                return f"{target.name} does not declare tensor_parallel"
            if not full:
                return "splits the family over two processes: runs with --full-matrix (CORERUN_FULL_MATRIX=1)"
            return [("gqa-untied", ModelCase(arch, {**BASE, **SHAPES["gqa-untied"], **extra}))]
        shapes = {**SHAPES, **(FULL_SHAPES if full else {})}
        return [(cid, ModelCase(arch, {**BASE, **shape, **extra})) for cid, shape in shapes.items()]

    # ------------------------------------------------------------ helpers
    def _build(self, case: Case) -> tuple[Any, Any, dict[str, Any]]:
        """``(corerun model, transformers model, checkpoint)``, both models float64 with the same random weights."""
        import torch

        from corerun.models.config import ModelConfig
        from corerun.models.loader import load_weights

        self.start(case)
        mc: ModelCase = case.config
        hf_model = reference_model(mc)
        state = saved_checkpoint(hf_model)
        config = ModelConfig.from_dict({**hf_model.config.to_dict(), "architectures": [mc.architecture]}, "tiny config")
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            model = case.target.create(config)
        finally:
            torch.set_default_dtype(previous)
        load_weights(model, state.items(), source=f"a random {mc.architecture} checkpoint")
        return model.eval(), hf_model, state

    # ------------------------------------------------------------ checks
    def test_weights(self, case: Case) -> None:
        import torch

        from corerun.models.errors import ModelLoadError
        from corerun.models.loader import load_weights

        model, _, state = self._build(case)
        dropped = next(k for k in state if ".layers.0." in k and k.endswith("weight") and "norm" not in k)
        broken = {k: v for k, v in state.items() if k != dropped}
        broken["model.layers.0.not_a_weight.weight"] = torch.zeros(3)
        with pytest.raises(ModelLoadError) as exc:
            load_weights(model, broken.items(), source="a checkpoint with one tensor removed and one added")
        msg = str(exc.value)
        for name, why in ((dropped, "missing"), ("model.layers.0.not_a_weight.weight", "unexpected")):
            if name not in msg:
                _fail(f"loading a checkpoint without {dropped} and with an extra tensor: the error does not name the "
                      f"{why} tensor {name}; it says:\n{msg}")

    def test_prefill(self, case: Case) -> None:
        model, hf, _ = self._build(case)
        ids = prompt(13, case.config.config["vocab_size"])
        _close("prefill of 13 tokens", Driver(model).run([(0, ids)])[0], hf_logits(hf, ids))

    def test_chunked_prefill(self, case: Case) -> None:
        model, hf, _ = self._build(case)
        ids = prompt(15, case.config.config["vocab_size"])
        chunks = [5, 4, 4, 1, 1]
        driver, got, start = Driver(model), [], 0
        table = driver.blocks(4)
        for n in chunks:
            got.append(driver.run([(start, ids[start : start + n])], tables=[table])[0])
            start += n
        import torch

        _close(f"prefill in chunks {chunks} (the last two decode steps)", torch.cat(got), hf_logits(hf, ids))

    def test_prefix_decode(self, case: Case) -> None:
        vocab = case.config.config["vocab_size"]
        model, hf, _ = self._build(case)
        first = prompt(12, vocab)
        second = first[:8] + prompt(5, vocab, seed=3)
        driver = Driver(model)
        table_a = driver.blocks(4)
        driver.run([(0, first)], tables=[table_a])
        table_b = table_a[:2] + driver.blocks(3)  # the first 8 tokens (2 blocks) are a prefix hit
        nxt = prompt(1, vocab, seed=5)
        decode_a, prefill_b = driver.run([(12, nxt), (8, second[8:])], tables=[table_a, table_b])
        _close("request 1 decoding in the step that request 2 prefills", decode_a, hf_logits(hf, first + nxt)[-1:])
        _close("request 2 after a prefix hit of 8 tokens on request 1's blocks", prefill_b, hf_logits(hf, second)[8:])
        seq, last = list(second), prefill_b
        for step in range(3):
            seq.append(int(last[-1].argmax()))
            (last,) = driver.run([(len(seq) - 1, seq[-1:])], tables=[table_b])
            _close(f"request 2's decode step {step + 1} after the prefix hit", last, hf_logits(hf, seq)[-1:])

    def test_preemption(self, case: Case) -> None:
        model, hf, _ = self._build(case)
        vocab = case.config.config["vocab_size"]
        seq = prompt(9, vocab, seed=11)
        driver = Driver(model)
        table = driver.blocks(5)
        logits = driver.run([(0, seq)], tables=[table])[0]
        for _ in range(3):
            seq.append(int(logits[-1].argmax()))
            logits = driver.run([(len(seq) - 1, seq[-1:])], tables=[table])[0]
        seq.append(int(logits[-1].argmax()))  # sampled in the step before the preemption
        driver.run([(0, prompt(4 * 5, vocab, seed=12))], tables=[table])  # another request overwrites every block
        fresh = driver.blocks(5)
        half = len(seq) // 2
        driver.run([(0, seq[:half])], tables=[fresh])
        (last,) = driver.run([(half, seq[half:])], tables=[fresh])
        _close(f"the recomputed second chunk ({len(seq) - half} tokens) after preemption", last, hf_logits(hf, seq)[half:])
        for step in range(2):
            seq.append(int(last[-1].argmax()))
            (last,) = driver.run([(len(seq) - 1, seq[-1:])], tables=[fresh])
            _close(f"decode step {step + 1} after preemption and recomputation", last, hf_logits(hf, seq)[-1:])

    def test_tensor_parallel(self, case: Case) -> None:
        import torch

        from corerun.conformance.model_parallel import tensor_parallel_logits

        model, _, state = self._build(case)
        ids = prompt(14, case.config.config["vocab_size"], seed=21)
        other = prompt(5, case.config.config["vocab_size"], seed=22)
        steps = [[(0, ids[:6])], [(6, ids[6:11]), (0, other)], [(11, ids[11:12]), (5, other[-1:])], [(12, ids[12:14])]]
        driver, rows = Driver(model), []
        tables = [driver.blocks(8), driver.blocks(8)]
        for step in steps:
            rows += driver.run(step, tables=tables[: len(step)])
        want = torch.cat(rows)
        try:
            got = tensor_parallel_logits(case.target.implementation_class(), model.config, state, steps)
        except RuntimeError as exc:
            _fail(f"the family on two tensor-parallel ranks: {exc}")
        _close("two tensor-parallel ranks (chunked prefill, a second request, decodes) against one process", got, want)

    def test_greedy(self, case: Case) -> None:
        import torch

        model, hf, _ = self._build(case)
        ids = prompt(6, case.config.config["vocab_size"])
        driver = Driver(model)
        table = driver.blocks(4)
        logits = driver.run([(0, ids)], tables=[table])[0]
        got = list(ids)
        for _ in range(8):
            got.append(int(logits[-1].argmax()))
            logits = driver.run([(len(got) - 1, got[-1:])], tables=[table])[0]
        want = list(ids)
        with torch.no_grad():
            for _ in range(8):
                want.append(int(hf_logits(hf, want)[-1].argmax()))
        if got != want:
            _fail(f"greedy tokens differ from transformers': corerun {got[6:]}, transformers {want[6:]}")


# ---------------------------------------------------------------- references and driving
def reference_model(mc: ModelCase) -> Any:
    """transformers' model of ``mc.architecture`` with ``mc.config``, random weights, float64, eager attention."""
    import torch
    import transformers

    from corerun.testing.tiny_models import randomize_

    cls = getattr(transformers, mc.architecture, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no class {mc.architecture}: no reference to compare with")
    config = cls.config_class(**mc.config)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # transformers' grouped products take no float64
    torch.manual_seed(0)
    model = cls(config).to(torch.float64)
    randomize_(model, seed=1)
    return model.eval()


def saved_checkpoint(model: Any) -> dict[str, Any]:
    """The tensors ``model.save_pretrained`` writes: the layout of checkpoints on disk (transformers 5 keeps
    experts stacked in memory but saves them one tensor per expert; a tied ``lm_head`` is not saved)."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        return {k: v for name in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(name).items()}


def hf_logits(model: Any, ids: list[int]) -> Any:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    import torch

    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _close(what: str, got: Any, want: Any) -> None:
    import torch

    if got.shape != want.shape:
        _fail(f"{what}: logits of shape {tuple(got.shape)}, transformers has {tuple(want.shape)}")
    if not torch.isfinite(got).all():
        _fail(f"{what}: non-finite logits (a read of KV-cache blocks the request does not own?)")
    err = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
    if err > TOLERANCE:
        row = int((got.double() - want.double()).abs().amax(dim=-1).argmax())
        _fail(f"{what}: float64 logits differ from transformers' by {err:.2e} (normwise, tolerance {TOLERANCE:.0e}); "
              f"worst at token row {row}")


class Driver:
    """Steps of requests through a model with the ``torch`` backend in float64 over a NaN-filled paged cache."""

    def __init__(self, model: Any, num_blocks: int = 40) -> None:
        import torch

        from corerun.attention.torch_backend import TorchAttentionBackend

        self.model = model
        self.backend = TorchAttentionBackend(model.attention_spec(torch.float64, BLOCK_SIZE, "cpu"))
        self.kv_caches = [self.backend.allocate_kv_cache(num_blocks).fill_(float("nan")) for _ in range(model.num_layers)]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7)).tolist()

    def blocks(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def run(self, requests: list[tuple[int, list[int]]], tables: list[list[int]] | None = None) -> list[Any]:
        """One step: request ``i`` = ``(cached, new_ids)`` adds ``new_ids`` after ``cached`` tokens in the cache
        (decodes first), in blocks ``tables[i]`` (new ones when not given); returns each request's logits rows."""
        import torch

        from corerun.protocols.forward_context import AttentionContext
        from corerun.protocols.step_layout import requests_step

        if tables is None:
            tables = [self.blocks(-(-(ctx + len(ids)) // BLOCK_SIZE)) for ctx, ids in requests]
        tokens = [t for _, ids in requests for t in ids]
        lens = [len(ids) for _, ids in requests]
        inputs = requests_step([c for c, _ in requests], lens, tables, BLOCK_SIZE, "cpu", input_ids=tokens)
        ctx = AttentionContext(self.backend, self.backend.plan(inputs.batch), self.kv_caches)
        with torch.no_grad():
            logits = self.model.compute_logits(self.model(inputs.input_ids, inputs.positions, ctx))
        return [] if logits is None else list(logits.double().split(lens))  # tensor parallel: ranks above 0 get none
