"""The shared conformance suite, adopted the way any plugin adopts it, end-to-end equality with
the torch reference backend through ``LLM``, and the graph-runner suite with triton attention inside
(emulated) CUDA graphs."""


import subprocess
import sys

from corerun.sdk import GraphRunnerCapabilities
from corerun.conformance import AttentionBackendSuite, GraphRunnerSuite
from corerun.testing import emulated_cuda_graph_runner


class TestTritonConformance(AttentionBackendSuite):
    implementation = "triton"


class TestTritonInsideCapturedGraphs(GraphRunnerSuite):
    """Triton declares ``cuda_graph_decode``: its capture-time plan must serve every later replay
    (float32 only, to keep the interpreter's time down; the GPU script runs every dtype).  The runner
    is corerun's ``cuda`` one with capture emulated: replays reuse the capture-time triton plan."""

    factory = staticmethod(emulated_cuda_graph_runner)
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

    def corerun(*args):  # the `corerun` command, as a user runs it (TRITON_INTERPRET passes on)
        return subprocess.run([sys.executable, "-m", "corerun", *args], capture_output=True, text=True, timeout=600)

    result = corerun("conformance", "attention:triton", "--option", "num_splits=4", "-k", "decode and fp32", "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    bad = corerun("conformance", "attention:triton", "--option", "num_splits=999", "-k", "decode and fp32", "--json")
    assert bad.returncode != 0 and "num_splits" in bad.stdout + bad.stderr
