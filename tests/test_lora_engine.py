"""Multi-LoRA serving end to end: random PEFT adapters on tiny models of every dense family (Llama,
Qwen2, Mistral, Qwen3, Gemma 2 and 3, Phi-3 with its merged q/k/v and gate/up), each request's greedy
tokens equal to transformers + PEFT with its adapter merged, mixed batches equal to each request alone,
prefix blocks never shared across adapters, more adapters than slots without a leak, and
mixture-of-experts models adapted on attention, their experts' adapters refused by name."""

from __future__ import annotations

import random
import re
import types
from pathlib import Path

import pytest
import torch

from corerun import LoRARequest, SamplingParams
from corerun.errors import RequestError
from corerun.testing.engines import assert_idle, make_llm
from corerun.testing.tiny_models import make_tiny_model
from tests.test_sliding_models import _hf_greedy

pytest.importorskip("peft")

MAX_TOKENS = 6
# (rank, alpha, rsLoRA, modules): attention and MLP projections, merged q/k/v and gate/up in part or whole
ADAPTERS = (
    (4, 8, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    (8, 4, True, ["q_proj", "v_proj", "down_proj"]),
    (2, 16, False, ["k_proj", "gate_proj"]),
    (6, 6, False, ["o_proj", "up_proj", "v_proj"]),
)
PROMPTS = [[5, 17, 99, 3, 41, 7, 230, 12, 9], [88, 2, 61], [14, 14, 150, 201, 33, 8, 72], [3, 250, 19, 5, 5]]


def _adapter(base: Path, out: Path, seed: int, rank: int, alpha: int, rslora: bool, modules: list[str]) -> tuple[Path, Path]:
    """A random PEFT adapter folder (B nonzero) for ``base``, and the base with it merged (a model folder)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=modules, init_lora_weights=False,
                        lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # PEFT's own random init is small next to the weights: make each adapter matter
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
    folder, merged = out / f"adapter-{seed}", out / f"merged-{seed}"
    peft_model.save_pretrained(str(folder))
    peft_model.merge_and_unload().save_pretrained(str(merged))
    return folder, merged


def _hf_tiny(tmp: Path, arch: str, **keys) -> Path:
    """A tiny random transformers model of class ``arch`` (Gemma 2 and 3 with the keys their model suite
    uses: a window of 8 the prompts run past, soft-capping that bites), saved under ``tmp``; the LM head
    untied (tied, Gemma's scaled embedding makes every tiny model repeat its last token, adapter or not)."""
    import transformers

    from corerun.testing.tiny_models import randomize_

    cls = getattr(transformers, arch)
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=256, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                tie_word_embeddings=False)
    torch.manual_seed(0)
    model = cls(cls.config_class(**{**base, **keys}))
    randomize_(model, seed=2)
    folder = tmp / f"tiny-{arch.removesuffix('ForCausalLM').lower()}"
    model.save_pretrained(folder)
    return folder


def _gemma(arch: str):
    from corerun.models import gemma

    return lambda tmp: _hf_tiny(tmp, arch, **getattr(gemma, arch).conformance_config)


# Phi-3's checkpoint (and PEFT's modules) hold q/k/v and gate/up merged: an adapter's lora_B has every slice's rows
PHI3_ADAPTERS = (
    (4, 8, False, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    (8, 4, True, ["qkv_proj", "down_proj"]),
)
# family -> (tiny model folder under a path, adapters): Llama and Qwen2 take every adapter, the others two
FAMILIES = {
    "llama": (lambda tmp: make_tiny_model(tmp, arch="llama"), ADAPTERS),
    "qwen2": (lambda tmp: make_tiny_model(tmp, arch="qwen2"), ADAPTERS),
    "mistral": (lambda tmp: make_tiny_model(tmp, arch="mistral", sliding_window=8), ADAPTERS[:2]),
    "qwen3": (lambda tmp: make_tiny_model(tmp, arch="qwen3"), ADAPTERS[:2]),
    "gemma2": (_gemma("Gemma2ForCausalLM"), ADAPTERS[:2]),
    "gemma3": (_gemma("Gemma3ForCausalLM"), ADAPTERS[:2]),
    "phi3": (lambda tmp: _hf_tiny(tmp, "Phi3ForCausalLM"), PHI3_ADAPTERS),
}


def _greedy(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens in float32 with eager attention (Gemma 2's soft-capping applies there only)."""
    return _hf_greedy(folder, prompts, MAX_TOKENS)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """A tiny model of the family, its adapters, and the reference tokens of every (adapter, prompt)."""
    tmp = tmp_path_factory.mktemp(f"lora-{request.param}")
    make, specs = FAMILIES[request.param]
    base = make(tmp)
    loras, refs = [], {None: _greedy(base, PROMPTS)}
    for i, spec in enumerate(specs):
        folder, merged = _adapter(base, tmp, i + 1, *spec)
        lora = LoRARequest(f"adapter{i + 1}", i + 1, str(folder))
        loras.append(lora)
        refs[lora.lora_int_id] = _greedy(merged, PROMPTS)
    return request.param, base, loras, refs


def _engine(base: Path, async_scheduling: bool = False, **lora):
    return make_llm(base, lora={"enabled": True, "max_loras": 4, "max_lora_rank": 8, **lora},
                    scheduler={"max_num_seqs": 8, "async_scheduling": async_scheduling})


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.timeout(240)
def test_mixed_batch_equals_peft_merged_and_each_request_alone(family):
    name, base, loras, refs = family
    assert all(refs[lora.lora_int_id] != refs[None] for lora in loras)  # every adapter changes the tokens
    with _engine(base) as llm:
        plan = [(p, lora) for p in range(len(PROMPTS)) for lora in [None, *loras]]
        outs = llm.generate([PROMPTS[p] for p, _ in plan], GREEDY, lora_request=[lora for _, lora in plan])
        for (p, lora), out in zip(plan, outs):
            want = refs[None if lora is None else lora.lora_int_id][p]
            assert out.outputs[0].token_ids == want, (p, lora)
        # seeded sampling: each request's tokens are the same in the mixed batch as alone
        sampled = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True) for i in range(len(plan))]
        mixed = llm.generate([PROMPTS[p] for p, _ in plan], sampled, lora_request=[lora for _, lora in plan])
        for i in (i for i in (0, 1, 2, 3, 4, 7, 13) if i < len(plan)):
            alone = llm.generate([PROMPTS[plan[i][0]]], sampled[i], lora_request=plan[i][1])
            assert alone[0].outputs[0].token_ids == mixed[i].outputs[0].token_ids, plan[i]
        assert_idle(llm)
        assert llm.engine.scheduler.lora_slots.num_pinned == 0


@pytest.mark.timeout(120)
def test_same_prompt_under_two_adapters_and_the_base_never_shares_a_block(family):
    name, base, loras, refs = family
    if name != "llama":
        pytest.skip("one family is enough for the cache keys")
    prompt = list(range(3, 3 + 17))  # four full blocks of 4 before the last token
    with _engine(base) as llm:
        kv = llm.engine.kv
        tables = {}
        # 40 tokens each: the engine's thread goes on decoding while the tables are read, so they must not finish first
        long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        streams = [llm.engine_loop.add_request(prompt, long, lora_request=lora) for lora in (None, loras[0], loras[1])]
        first = [next(iter(s)) for s in streams]  # every request has computed its prompt: all hold their blocks
        for lora, out in zip((None, loras[0], loras[1]), first):
            seq = llm.engine.requests[out.request_id]
            tables[lora] = set(kv.block_table(seq.seq_id))
        finals = []
        for s in streams:
            for last in s:
                pass
            finals.append(last.outputs[0].token_ids[:MAX_TOKENS])
        a, b, c = tables.values()
        assert not (a & b) and not (a & c) and not (b & c)
        hits = kv.stats().prefix_hits
        again = llm.generate([prompt], GREEDY, lora_request=loras[0])  # the same adapter again: its prefix is reused
        assert kv.stats().prefix_hits - hits == 16
        alone = llm.generate([prompt], GREEDY, lora_request=loras[2])  # a third adapter: nothing to reuse
        assert kv.stats().prefix_hits - hits == 16
        assert again[0].outputs[0].token_ids == finals[1]  # the reused blocks hold what this adapter computed
        assert len({tuple(t) for t in finals}) == 3 and alone[0].outputs[0].token_ids not in finals
        assert_idle(llm)


@pytest.mark.timeout(240)
def test_more_adapters_than_slots_all_finish_unchanged_with_aborts(family):
    name, base, loras, refs = family
    if name != "llama":
        pytest.skip("one family is enough for the soak")
    rng = random.Random(7)
    # 4 adapters, 2 slots, 2 kept in host memory; asynchronous scheduling: slots change while a step is in flight
    with _engine(base, async_scheduling=True, max_loras=2, max_cpu_loras=2) as llm:
        for _ in range(3):
            plan = [(rng.randrange(len(PROMPTS)), rng.choice([None, *loras])) for _ in range(10)]
            streams = [llm.engine_loop.add_request(PROMPTS[p], GREEDY, lora_request=lora) for p, lora in plan]
            aborted = set(rng.sample(range(len(plan)), 3))
            llm.abort([streams[i].request_id for i in aborted])
            for i, ((p, lora), stream) in enumerate(zip(plan, streams)):
                last = None
                for last in stream:
                    pass
                if i in aborted and last.outputs[0].finish_reason == "abort":
                    continue
                assert last.outputs[0].token_ids == refs[None if lora is None else lora.lora_int_id][p], (p, lora)
            assert_idle(llm, timeout=5)
            assert llm.engine.scheduler.lora_slots.num_pinned == 0


@pytest.mark.timeout(120)
def test_adapters_that_do_not_fit_are_refused_at_load_by_name(family, tmp_path):
    name, base, loras, refs = family
    if name != "llama":
        pytest.skip("one family is enough for the errors")
    other = make_tiny_model(tmp_path, arch="llama", hidden_size=32, intermediate_size=64)
    wrong_shape, _ = _adapter(other, tmp_path, 9, 4, 8, False, ["q_proj"])
    lm_head, _ = _adapter(base, tmp_path, 10, 4, 8, False, ["q_proj", "lm_head"])
    with _engine(base, max_lora_rank=4) as llm:
        cases = [
            (LoRARequest("big", 1, loras[1].lora_path), r"rank 8, above lora.max_lora_rank=4"),
            (LoRARequest("shape", 2, str(wrong_shape)), r"module 'model.layers.0.self_attn.q_proj' has lora_A \(4, 32\)"),
            (LoRARequest("head", 3, str(lm_head)), r"adapter 'head': (tensor|module) 'base_model\.model\.lm_head|module 'lm_head'"),
            (LoRARequest("nowhere", 4, str(tmp_path / "missing")), r"is not a folder"),
        ]
        for lora, message in cases:
            with pytest.raises(RequestError, match=message):
                llm.generate([PROMPTS[0]], GREEDY, lora_request=lora)
        assert llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids == refs[None][0]  # the engine serves on
    with make_llm(base) as plain, pytest.raises(RequestError, match="LoRA is off"):
        plain.generate([PROMPTS[0]], GREEDY, lora_request=loras[0])


def _emulated_graphs(register):
    """The built-in ``cuda`` graph runner with the capture emulated, registered as a CPU graph runner."""
    from corerun.plugin.capabilities import GraphRunnerCapabilities
    from corerun.testing.graphs import emulated_cuda_graph_runner

    register("emulated-cuda", emulated_cuda_graph_runner,
             capabilities=GraphRunnerCapabilities(devices=frozenset({"cpu"}), captures=True))


@pytest.mark.timeout(120)
def test_decodes_with_adapters_replay_captured_graphs_with_the_steps_slots(family):
    from corerun.config import load_config
    from corerun.engine.llm_engine import LLMEngine
    from corerun.plugin.hookspecs import hookimpl
    from corerun.plugin.registry import Registry
    from corerun.testing.engines import TEST_DEFAULTS

    name, base, loras, refs = family
    if name != "llama":
        pytest.skip("one family is enough for the graphs")
    registry = Registry.from_environment()
    plugin = types.SimpleNamespace(corerun_graph_runners=hookimpl(_emulated_graphs))
    registry.register_module(plugin, plugin="tests-emulated-graphs", distribution="tests", version="0")
    config = load_config(None, overrides={**TEST_DEFAULTS, "model": str(base), "graph": {"runner": "emulated-cuda", "max_batch_size": 8},
                                          "lora": {"enabled": True, "max_loras": 2, "max_lora_rank": 8}})
    engine = LLMEngine(config, registry)
    try:
        plan = [(0, loras[0]), (1, None), (2, loras[1]), (3, loras[0]), (1, loras[1])]
        seqs = {engine.add_request(PROMPTS[p], GREEDY, lora_request=lora): (p, lora) for p, lora in plan}
        done = {}
        while engine.scheduler.has_unfinished():
            for seq in engine.step():
                done[seq.request_id] = seq
        for rid, (p, lora) in seqs.items():
            assert done[rid].output_token_ids == refs[None if lora is None else lora.lora_int_id][p], (p, lora)
        assert engine.runner.graph.stats.replays >= MAX_TOKENS - 1  # the decodes replayed the captured steps
    finally:
        engine.shutdown()


@pytest.mark.timeout(240)
def test_tensor_parallel_ranks_serve_their_share_of_each_adapter(family):
    """Two ranks: column-parallel layers keep their rows of B, row-parallel ones their columns of A (the
    partial products join the base's all-reduce); tokens equal transformers + PEFT merged."""
    name, base, loras, refs = family
    if name != "llama":
        pytest.skip("one family is enough for tensor parallelism")
    with make_llm(base, tensor_parallel_size=2, distributed={"start_method": "forkserver"},
                  lora={"enabled": True, "max_loras": 2, "max_lora_rank": 8}) as llm:
        plan = [(0, loras[0]), (1, None), (2, loras[1]), (3, loras[3]), (0, loras[2])]
        outs = llm.generate([PROMPTS[p] for p, _ in plan], GREEDY, lora_request=[lora for _, lora in plan])
        for (p, lora), out in zip(plan, outs):
            assert out.outputs[0].token_ids == refs[None if lora is None else lora.lora_int_id][p], (p, lora)
        assert_idle(llm)


def _raw_adapter(folder: Path, modules: dict[str, tuple[int, int]], rank: int = 4) -> str:
    """A PEFT folder written by hand: a random ``lora_A`` ``[rank, in]`` / ``lora_B`` ``[out, rank]`` per module."""
    import json

    from safetensors.torch import save_file

    folder.mkdir()
    g = torch.Generator().manual_seed(11)
    tensors = {f"base_model.model.{m}.lora_{k}.weight": torch.randn(shape, generator=g)
               for m, (n_in, n_out) in modules.items() for k, shape in (("A", (rank, n_in)), ("B", (n_out, rank)))}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 8}))
    return str(folder)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("arch", "moe"), [
    ("MixtralForCausalLM", ["block_sparse_moe.experts.0.w1", "block_sparse_moe.gate", "mlp.gate"]),
    ("Qwen2MoeForCausalLM", ["mlp.experts.1.down_proj", "mlp.shared_expert.gate_proj", "mlp.shared_expert_gate"]),
], ids=["mixtral", "qwen2-moe"])
def test_mixture_of_experts_take_attention_adapters_and_refuse_the_experts_by_name(tmp_path, arch, moe):
    """Attention adapters on a mixture-of-experts model equal transformers + PEFT merged; an adapter on
    an expert, the router or the shared expert (Mixtral's older per-expert checkpoints name them) is
    refused when it loads, naming the module."""
    from corerun.models import mixtral, qwen_moe

    keys = {"MixtralForCausalLM": mixtral.MixtralForCausalLM, "Qwen2MoeForCausalLM": qwen_moe.Qwen2MoeForCausalLM}[arch]
    base = _hf_tiny(tmp_path, arch, **keys.conformance_config)
    folder, merged = _adapter(base, tmp_path, 1, 4, 8, False, ["q_proj", "k_proj", "v_proj", "o_proj"])
    want, plain = _greedy(merged, PROMPTS[:2]), _greedy(base, PROMPTS[:2])
    assert want != plain
    attention = LoRARequest("attention", 1, str(folder))
    with _engine(base) as llm:
        outs = llm.generate(PROMPTS[:2] * 2, GREEDY, lora_request=[attention, attention, None, None])
        assert [o.outputs[0].token_ids for o in outs] == want + plain
        for i, module in enumerate(moe):
            bad = _raw_adapter(tmp_path / f"moe-{i}", {f"model.layers.0.self_attn.q_proj": (64, 64),
                                                       f"model.layers.0.{module}": (64, 32)})
            with pytest.raises(RequestError, match=rf"module 'model\.layers\.0\.{re.escape(module)}' is part of a "
                                                   r"mixture-of-experts block .* attention projections \['q_proj'"):
                llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest(f"moe{i}", 2 + i, bad))
        assert_idle(llm)


@pytest.mark.timeout(120)
def test_each_step_builds_its_bookkeeping_once_for_every_layer(family, monkeypatch):
    """LoRATokens.update runs once per step, and every adapted layer of that step gets that one build."""
    from corerun.lora.grouped import GroupedLoRAKernel
    from corerun.lora.tokens import LoRATokens

    name, base, loras, refs = family
    if name != "llama":
        pytest.skip("one family is enough for the bookkeeping")
    builds, calls = [0], []
    update, add_lora = LoRATokens.update, GroupedLoRAKernel.add_lora

    def counted_update(self, step_slots):
        builds[0] += 1
        update(self, step_slots)

    def recorded_add_lora(self, y, x, a, b, scalings, tokens, output_slices):
        calls.append((builds[0], id(tokens)))
        add_lora(self, y, x, a, b, scalings, tokens, output_slices)

    monkeypatch.setattr(LoRATokens, "update", counted_update)
    monkeypatch.setattr(GroupedLoRAKernel, "add_lora", recorded_add_lora)
    with _engine(base) as llm:
        layers = len(llm.engine.runner.lora.layers)  # 2 layers x (qkv, o, gate_up, down)
        outs = llm.generate(PROMPTS[:2], GREEDY, lora_request=[loras[0], None])
        assert [o.outputs[0].token_ids for o in outs] == [refs[1][0], refs[None][1]]
    per_step = {}
    for build, _ in calls:
        per_step[build] = per_step.get(build, 0) + 1
    assert layers == 8 and builds[0] >= MAX_TOKENS and len({t for _, t in calls}) == 1
    assert set(per_step) == set(range(1, builds[0] + 1)) and set(per_step.values()) == {layers}
