"""The ``triton`` LoRA kernel in Triton's interpreter: the LoRA kernel suite (float32 and bfloat16, to
keep the interpreter's time down; the GPU script runs every dtype and the CUDA-graph replay)."""

from corerun.conformance import LoRAKernelSuite


class TestTritonLoRAConformance(LoRAKernelSuite):
    implementation = "triton"

    def configs(self, check, target, full):
        made = super().configs(check, target, full)
        return made if isinstance(made, str) else [(cid, cfg) for cid, cfg in made if cfg.dtype in ("float32", "bfloat16")]
