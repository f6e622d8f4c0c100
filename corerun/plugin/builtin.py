"""corerun's own implementations, registered through the same hooks as any installed plugin."""

from __future__ import annotations

from corerun.attention.capabilities import CAPABILITIES as TORCH_ATTENTION
from corerun.lora.capabilities import GROUPED_KERNEL as GROUPED_LORA, TORCH_KERNEL as TORCH_LORA
from corerun.plugin.capabilities import (
    ExecutorCapabilities, FusedOpsCapabilities, GraphRunnerCapabilities, KVCacheCapabilities, ModelCapabilities,
)
from corerun.plugin.hookspecs import Register, hookimpl
from corerun.quantization import capabilities as quantization_caps
from corerun.sampler.options import CAPABILITIES as FULL_SAMPLER_CAPABILITIES, FullSamplerOptions
from corerun.tool_parsers.hermes import HermesToolParser
from corerun.tool_parsers.llama3_json import Llama3JsonToolParser
from corerun.tool_parsers.mistral import MistralToolParser
from corerun.tool_parsers.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser


@hookimpl
def corerun_attention_backends(register: Register) -> None:
    register(
        "torch",
        "corerun.attention.torch_backend:TorchAttentionBackend",
        capabilities=TORCH_ATTENTION,
        priority=0,
        description="reference paged attention in plain torch; runs anywhere; the conformance oracle (float64)",
    )


@hookimpl
def corerun_kv_cache_managers(register: Register) -> None:
    register(
        "paged",
        "corerun.kv_cache.paged:PagedKVCacheManager",
        capabilities=KVCacheCapabilities(prefix_caching=True),
        description="fixed-size blocks, reference counts, prefix caching by chained block hashes",
    )


@hookimpl
def corerun_graph_runners(register: Register) -> None:
    register(
        "eager",
        "corerun.graph.eager:EagerGraphRunner",
        capabilities=GraphRunnerCapabilities(devices=frozenset({"cpu", "cuda"}), captures=False, passthrough=True),
        description="runs every step eagerly",
    )
    register(
        "cuda",
        "corerun.graph.cuda:CudaGraphRunner",
        capabilities=GraphRunnerCapabilities(devices=frozenset({"cuda"}), captures=True),
        probe="corerun.graph.cuda:probe",
        priority=10,  # above eager wherever it fits (a CUDA device, a graph-safe attention backend)
        description="captures pure-decode steps in CUDA graphs by batch-size bucket, replays them",
    )
    register(
        "replay",
        "corerun.graph.replay:ReplayGraphRunner",
        capabilities=GraphRunnerCapabilities(devices=frozenset({"cpu"}), captures=False, tensor_parallel=False, records=True),
        priority=5,  # above eager on a CPU, with a backend that declares replay_decode (each recording is checked too)
        description="records a CPU's pure-decode steps by batch-size bucket and replays their calls without Python",
    )
    register(
        "compile",
        "corerun.graph.compiled:CompileGraphRunner",
        capabilities=GraphRunnerCapabilities(devices=frozenset({"cpu", "cuda"}), captures=False, tensor_parallel=False),
        probe="corerun.graph.compiled:probe",
        priority=-10,  # never auto: its first compile takes minutes on a small CPU (docs/graphs.md)
        description="torch.compile of the model with attention kept out of the graph; fused elementwise work, compiled once at startup",
    )


@hookimpl
def corerun_samplers(register: Register) -> None:
    register(
        "full",
        "corerun.sampler.full:FullSampler",
        capabilities=FULL_SAMPLER_CAPABILITIES,
        options=FullSamplerOptions,
        priority=10,
        description="vLLM's pipeline: logit bias, min_tokens, penalties, temperature, min-p, top-k, top-p, logprobs, seeds",
    )


@hookimpl
def corerun_tool_parsers(register: Register) -> None:
    for parser, description in (
        (HermesToolParser, "Hermes and Qwen 2.5/3: <tool_call>{json}</tool_call>"),
        (Llama3JsonToolParser, "Llama 3.1-3.3: an answer that is {\"name\": ..., \"parameters\": ...} objects, ;-separated"),
        (MistralToolParser, "Mistral: [TOOL_CALLS] then a JSON list, or name[ARGS]{json} per call"),
    ):
        register(parser.name, parser, capabilities=parser.capabilities, description=description)


@hookimpl
def corerun_quantization_methods(register: Register) -> None:
    register("none", "corerun.quantization.dense:DenseMethod", capabilities=quantization_caps.DENSE,
             description="dense float weights, as always; a GGUF file is dequantized once at load")
    register("gguf", "corerun.quantization.gguf_method:GGUFMethod", capabilities=quantization_caps.GGUF,
             priority=10,  # auto reads a GGUF file packed
             description="GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) kept packed, dequantized per layer in torch")
    for name, cls, caps, description in (
        ("gptq", "GPTQMethod", quantization_caps.GPTQ, "GPTQ checkpoints (4/8-bit, groups, act-order), packed as stored"),
        ("awq", "AWQMethod", quantization_caps.AWQ, "AWQ GEMM checkpoints (4-bit, zero points), packed as stored"),
        ("compressed-tensors", "CompressedTensorsMethod", quantization_caps.COMPRESSED_TENSORS,
         "llm-compressor's W4A16 (pack-quantized), W8A8 / W8A16 int8 and FP8 checkpoints"),
        ("fp8", "FP8Method", quantization_caps.FP8, "FP8 e4m3 weights with per-tensor or per-channel scales"),
    ):
        register(name, f"corerun.quantization.packed_method:{cls}", capabilities=caps, description=description)


@hookimpl
def corerun_reasoning_parsers(register: Register) -> None:
    for parser, description in (
        (DeepSeekR1ReasoningParser, "<think>...</think>, opened by the chat template: the answer starts inside the thinking"),
        (Qwen3ReasoningParser, "<think>...</think> when the answer opens with it (Qwen3's enable_thinking)"),
    ):
        register(parser.name, parser, capabilities=parser.capabilities, description=description)


# architecture (config.json) -> (class, what differs from Llama); every one splits over tensor-parallel ranks, and
# its layers attend fully or through a sliding window as config.json says (layer_types, sliding_window)
MODEL_FAMILIES = {
    "LlamaForCausalLM": ("corerun.models.llama:LlamaForCausalLM", "Llama 2/3, SmolLM/SmolLM2, TinyLlama"),
    "MistralForCausalLM": ("corerun.models.llama:MistralForCausalLM", "Mistral (dense): every layer through sliding_window"),
    "Qwen2ForCausalLM": ("corerun.models.qwen2:Qwen2ForCausalLM", "Qwen2 / Qwen2.5: bias on q, k, v"),
    "Qwen3ForCausalLM": ("corerun.models.qwen3:Qwen3ForCausalLM", "Qwen3 (dense): per-head RMSNorm of q and k"),
    "Phi3ForCausalLM": ("corerun.models.phi3:Phi3ForCausalLM", "Phi-3 (dense): fused qkv and gate-up in the checkpoint, LongRoPE"),
    "Gemma2ForCausalLM": ("corerun.models.gemma:Gemma2ForCausalLM",
                          "Gemma 2: GeGLU, (1 + w) norms, local/global layers, attention and final soft-capping"),
    "Gemma3ForCausalLM": ("corerun.models.gemma:Gemma3ForCausalLM",
                          "Gemma 3 (text): Gemma 2's layers with q/k norms, 5 local : 1 global, a local rope base"),
}
LAYER_KINDS = frozenset({"full", "sliding"})
EXPERT_FAMILIES = {  # the same, with mixture-of-experts layers (corerun.models.moe)
    "MixtralForCausalLM": ("corerun.models.mixtral:MixtralForCausalLM", "Mixtral: top-k experts renormalised"),
    "Qwen2MoeForCausalLM": ("corerun.models.qwen_moe:Qwen2MoeForCausalLM",
                            "Qwen1.5-MoE / Qwen2-MoE: experts (norm_topk_prob) and a sigmoid-gated shared expert"),
    "Qwen3MoeForCausalLM": ("corerun.models.qwen_moe:Qwen3MoeForCausalLM", "Qwen3-MoE: experts, q/k norms"),
}


@hookimpl
def corerun_models(register: Register) -> None:
    for arch, (factory, description) in MODEL_FAMILIES.items():
        register(arch, factory, capabilities=ModelCapabilities(tensor_parallel=True, attention=LAYER_KINDS),
                 description=description)
    for arch, (factory, description) in EXPERT_FAMILIES.items():
        register(arch, factory, capabilities=ModelCapabilities(tensor_parallel=True, attention=LAYER_KINDS, experts=True),
                 description=description)


@hookimpl
def corerun_executors(register: Register) -> None:
    register("inproc", "corerun.executor.inproc:InProcExecutor",
             capabilities=ExecutorCapabilities(max_world_size=1, async_safe=True),
             description="one rank: the engine's own process, nothing started")
    register("local", "corerun.executor.local:LocalExecutor", capabilities=ExecutorCapabilities(),
             description="ranks 1..N-1 as child processes of this host, commands over pipes")
    register("launched", "corerun.executor.launched:LaunchedExecutor",
             capabilities=ExecutorCapabilities(multi_host=True, starts_ranks=False),
             description="ranks started by torchrun or by hand, joined at distributed.init_method")
    register("ray", "corerun.executor.ray_executor:RayExecutor", capabilities=ExecutorCapabilities(multi_host=True),
             probe="corerun.executor.ray_executor:probe",
             description="ranks 1..N-1 as Ray actors in a placement group, on this host or a Ray cluster (corerun[ray])")


@hookimpl
def corerun_lora_kernels(register: Register) -> None:
    register("torch", "corerun.lora.reference:TorchLoRAKernel", capabilities=TORCH_LORA,
             description="each token gathers its slot's A and B, two batched products: the reference (graph safe)")
    # faster than the reference on CPU (benchmarks/RESULTS.md); on CUDA its host read would stall every layer
    register("grouped", "corerun.lora.grouped:GroupedLoRAKernel", capabilities=GROUPED_LORA, priority={"cpu": 5, "cuda": -5},
             description="tokens sorted by slot, two products per adapter present (host sync: not graph safe)")


@hookimpl
def corerun_fused_ops(register: Register) -> None:
    register("torch", "corerun.models.fused_ops:TorchFusedOps", capabilities=FusedOpsCapabilities(),
             description="the layers' own torch code (RMSNorm, SiLU-and-mul, RoPE), run inline: the reference")
