"""The shared conformance suite, adopted the way any plugin adopts it, end-to-end equality with
the torch reference backend through ``LLM``, and the graph-runner suite with triton attention inside
(emulated) CUDA graphs."""


from corerun.capabilities import GraphRunnerCapabilities
from corerun.conformance import AttentionBackendSuite, GraphRunnerSuite


class TestTritonConformance(AttentionBackendSuite):
    implementation = "triton"


def _emulated_cuda_runner(model, attention, limits):
    """The real ``cuda`` graph runner with capture emulated: replays reuse the capture-time triton plan."""
    from corerun.graph.capturer import EmulatedGraphCapturer
    from corerun.graph.cuda import CudaGraphRunner

    return CudaGraphRunner(model, attention, limits, capturer=EmulatedGraphCapturer(), progress=False)


class TestTritonInsideCapturedGraphs(GraphRunnerSuite):
    """Triton declares ``cuda_graph_decode``: its capture-time plan must serve every later replay
    (float32 only, to keep the interpreter's time down; the GPU script runs every dtype)."""

    factory = staticmethod(_emulated_cuda_runner)
    capabilities = GraphRunnerCapabilities(devices=frozenset({"cpu"}), captures=True)
    attention_backend = "triton"

    def configs(self, check, target, full):
        return [(cid, cfg) for cid, cfg in super().configs(check, target, full) if cfg.dtype == "float32"]


class TestTritonSplitKVInsideCapturedGraphs(TestTritonInsideCapturedGraphs):
    """The split-KV decode (its workspace allocated inside ``forward``) inside captured graphs: the
    interpreter knows no SM count and never splits on its own, so the split is forced."""

    attention_options = {"num_splits": 4}


def test_llm_greedy_equals_torch_backend(tmp_path):
    from corerun import LLM, SamplingParams
    from corerun.testing.tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path, arch="llama")
    prompts = [[7], list(range(3, 19)), list(range(40, 57)), [9, 8, 7, 6, 5] * 4]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    common = dict(model=model_dir, device="cpu", dtype="float32", kv_cache={"block_size": 16, "num_blocks": 16},
                  scheduler={"max_model_len": 64, "max_num_batched_tokens": 24})
    ref = [o.outputs[0].token_ids for o in LLM(attention="torch", **common).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(attention="triton", **common)
    assert llm.engine.runner.attention_name == "triton"
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == ref


def test_forced_split_kv_passes_the_decode_checks_through_the_cli():
    """``--option num_splits=4`` reaches the backend: decodes take the split-KV kernels, which the suite checks."""
    from click.testing import CliRunner

    from corerun.cli import cli

    result = CliRunner().invoke(cli, ["conformance", "attention:triton", "--option", "num_splits=4", "-k", "decode and fp32", "--json"])
    assert result.exit_code == 0, result.output
    bad = CliRunner().invoke(cli, ["conformance", "attention:triton", "--option", "num_splits=999", "-k", "decode and fp32", "--json"])
    assert bad.exit_code != 0 and "num_splits" in bad.output
