"""Throw-away plugin distributions a stranger might install beside corerun (see test_plugin_platform.py).

- ``narrow``: a correct backend on corerun.sdk (float32, head size 16, block size 16, no GQA, CPU, priority 5),
  small enough that its whole conformance run takes seconds: certified, ``auto`` may choose it;
- ``nocausal``: attention with no causal mask, priority 1 on every device (the silent takeover);
- ``evil``: registers the built-in ``torch`` attention name and the first-party ``full`` sampler name,
  plus a sampler of its own, ``evil_extra``;
- ``lazykernel``: imports its kernel module (not installed) only when the backend is built;
- ``badimport``: its backend module imports a kernel library that is not installed.
"""

from __future__ import annotations

from tests.helpers.thirdparty import PluginPackage

_SDK_BACKEND = '''
from corerun.sdk.attention import DenseAttentionBackend, reference_attention

from {package}.plugin import CAPABILITIES


class Backend(DenseAttentionBackend):
    name = "{name}"
    capabilities = CAPABILITIES

    def attend(self, query, k_cache, v_cache, plan, out):
        reference_attention(query, k_cache, v_cache, plan.batch, self.spec.softmax_scale, out)
'''


def _attention(name: str, capabilities: str, priority: str, backend: str) -> PluginPackage:
    package = f"corerun_attention_{name}"
    return PluginPackage(
        distribution=f"corerun-attention-{name}",
        package=package,
        entry_point=name,
        modules={
            "plugin": f'''
                from corerun import AttentionCapabilities, hookimpl

                CAPABILITIES = AttentionCapabilities({capabilities})


                @hookimpl
                def corerun_attention_backends(register):
                    register("{name}", "{package}.backend:Backend", capabilities=CAPABILITIES, priority={priority})
            ''',
            "backend": backend.format(package=package, name=name),
        },
    )


NARROW = _attention(
    "narrow",
    'dtypes=frozenset({"float32"}), head_sizes=frozenset({16}), block_sizes=frozenset({16}), devices=frozenset({"cpu"}), gqa=False',
    "5",
    _SDK_BACKEND,
)
NOCAUSAL = _attention(
    "nocausal",
    'dtypes=frozenset({"float16", "bfloat16", "float32"}), devices=frozenset({"cpu", "cuda"})',
    "1",
    '''
import torch
from torch.nn.functional import scaled_dot_product_attention

from corerun.sdk.attention import DenseAttentionBackend

from {package}.plugin import CAPABILITIES


class Backend(DenseAttentionBackend):
    name = "{name}"
    capabilities = CAPABILITIES

    def attend(self, query, k_cache, v_cache, plan, out):
        batch, bs = plan.batch, k_cache.shape[1]
        starts, lens = batch.query_start_loc_cpu.tolist(), batch.seq_lens_cpu.tolist()
        for i in range(batch.num_reqs):
            s, e, n = starts[i], starts[i + 1], lens[i]
            blocks = batch.block_tables[i, : (n + bs - 1) // bs].long()
            group = query.shape[1] // k_cache.shape[2]
            k = k_cache[blocks].flatten(0, 1)[:n].repeat_interleave(group, 1).transpose(0, 1)
            v = v_cache[blocks].flatten(0, 1)[:n].repeat_interleave(group, 1).transpose(0, 1)
            q = query[s:e].transpose(0, 1)
            out[s:e] = scaled_dot_product_attention(q, k, v, scale=self.spec.softmax_scale).transpose(0, 1)  # no causal mask
''',
)
LAZYKERNEL = _attention(
    "lazykernel",
    'dtypes=frozenset({"float32"}), devices=frozenset({"cpu"})',
    "0",
    '''
from corerun.sdk.attention import DenseAttentionBackend

from {package}.plugin import CAPABILITIES


class Backend(DenseAttentionBackend):
    name = "{name}"
    capabilities = CAPABILITIES

    def __init__(self, spec):
        super().__init__(spec)
        import corerun_lazykernel_ext  # the compiled kernel, imported when the backend is built; not installed
''',
)
BADIMPORT = _attention(
    "badimport",
    'dtypes=frozenset({"float32"}), devices=frozenset({"cpu"})',
    "0",
    '''
import corerun_badimport_ext  # the compiled kernel; not installed
''',
)
EVIL = PluginPackage(
    distribution="corerun-evil",
    package="corerun_evil",
    entry_point="evil",
    modules={
        "plugin": '''
            from corerun import SamplerCapabilities, hookimpl


            @hookimpl
            def corerun_attention_backends(register):
                register("torch", "corerun_evil.nothing:Backend", priority=100)


            @hookimpl
            def corerun_samplers(register):
                register("full", "corerun_evil.nothing:Sampler", capabilities=SamplerCapabilities(params=frozenset()))
                register("evil_extra", "corerun_sampler_basic.sampler:BasicSampler",
                         capabilities=SamplerCapabilities(params=frozenset({"temperature", "seed"})))
        '''
    },
)
ALL = (NARROW, NOCAUSAL, LAZYKERNEL, BADIMPORT, EVIL)
