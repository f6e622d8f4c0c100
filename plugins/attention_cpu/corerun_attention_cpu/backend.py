"""``CpuAttentionBackend``: paged attention on CPU that reads the KV cache in place.

KV cache, one tensor per layer: the usual dense ``[2, num_blocks, block_size, num_kv_heads,
head_size]`` (K at 0, V at 1) in the model's dtype, zeroed at allocation (``DenseKVCache``); with a
quantized ``spec.kv_cache_dtype`` the same in fp8, or int8 rows of ``head_size + 2`` bytes (the values,
then their float16 scale), quantized in torch on write (``corerun.protocols.kv_quant``) and
dequantized by the kernel as it reads each block.

``plan`` makes the step's lengths, block tables and slot mapping contiguous int32 / int64 tensors,
and the kernel's arguments that describe them, once per step; ``forward`` makes two C calls per
layer: the K/V write by slot mapping, then the attention of every request's query tokens over its
own blocks (the kernel in ``csrc/paged_attention.cpp``), on ``torch.get_num_threads()`` threads,
adding only the layer's tensors' addresses and strides to those arguments.  Nothing is gathered or
copied per step beyond the new tokens' K/V.

A fresh prompt (nothing cached before it: its whole sequence is this step's query) is attended on the
step's own K/V instead of through the cache, by one of two routes:

* bfloat16 on a CPU with AMX-BF16 (head size 64 or 128): every fresh prompt of at least
  ``AMX_MIN_TOKENS`` tokens goes to ONE call per layer of ``csrc/prefill_amx.cpp`` (causal flash
  attention on AMX tiles: S = Q K^T and O += P V by TDPBF16PS, the online softmax in AVX-512, the
  probabilities rounded to bfloat16 as flash attention's are).  Measured (benchmarks/RESULTS.md, "AMX
  prefill attention (tenth session)"): ahead of the paged kernel from 24 tokens (below it the kernel
  keeps them) and of SDPA at every length; one layer, 24 prompts of 32-256 tokens 2.6x the route
  before it, one prompt of 2048 tokens 2.0x SDPA.
* otherwise a prompt of at least ``sdpa_min_tokens(dtype, CPU flags)`` tokens goes to torch's
  ``scaled_dot_product_attention``, one call per prompt: its CPU flash kernel multiplies larger tiles
  through oneDNN's brgemm micro-kernels.  The thresholds are measured (benchmarks/RESULTS.md, "prefill
  attention" and "Seventeenth session"): in bfloat16 on a CPU with AMX-BF16 (where corerun's own AMX call
  is unavailable) SDPA is ahead from about 128 tokens (2.5-3x at 1-2k), since oneDNN multiplies on the
  tiles; on a CPU without AMX (an AMD EPYC with AVX512_BF16) it is behind the kernel at every length (one
  layer, one thread: 8.5 against 3.4 ms for a 512-token prompt, 82 against 52 at 2048), so bfloat16 stays
  in the kernel there; in float32 the kernel's query tiles keep up with SDPA to about 2k tokens; float16
  never goes there.  In bfloat16 SDPA's probabilities are rounded to bfloat16 before the product with V,
  as flash attention's are.

``plan`` sends such prompts there and the runs of other requests between them to the kernel, one call
per run; without a soft cap, a sliding window or a quantized cache.  Whether AMX is usable is asked once
per process (CPUID and the kernel's grant of the tile state); a library built without it, or a refusal
at run time, keeps the SDPA route.

The kernel checks the batch before it reads anything (query ranges, lengths against the block
table's width, every block id it will read against the cache's size, every slot against the
cache) and the backend turns a refusal into a ``ValueError`` naming the request, the field and the
value, instead of reading out of bounds.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import ClassVar

import torch

from corerun.protocols import kv_quant
from corerun.protocols.replay import native
from corerun.sdk import AttentionCapabilities
from corerun.errors import UnsupportedError
from corerun.protocols.attention import AttentionBatch, AttentionSpec, dtype_name
from corerun.sdk.attention import DenseKVCache, zeros_kv_cache
from corerun_attention_cpu import kernels
from corerun_attention_cpu.capabilities import CPU_CAPABILITIES

logger = logging.getLogger("corerun_attention_cpu")

IMPLEMENTATION = "attention backend 'cpu'"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # enum DType in the source
KV_TYPE_CODES = {"auto": 0, "fp8_e4m3": 1, "fp8_e5m2": 2, "int8": 3}  # enum KVType in the source
# a fresh prompt at least this long goes to torch's SDPA, per dtype (module docstring); None: never.
# bfloat16's figure holds only where the CPU has AMX-BF16 (sdpa_min_tokens)
SDPA_MIN_TOKENS: dict[torch.dtype, int | None] = {torch.bfloat16: 128, torch.float32: 2048, torch.float16: None}
# bfloat16 with AMX: a fresh prompt at least this long goes to csrc/prefill_amx.cpp (module docstring)
AMX_MIN_TOKENS = 24
AMX_HEAD_SIZES = (64, 128)
AMX_NO_AMX = 7  # the call's code for "no AMX path here"


def sdpa_min_tokens(dtype: torch.dtype, cpu_flags: frozenset[str]) -> int | None:
    """The shortest fresh prompt that goes to torch's SDPA on a CPU with these flags (None: none does).

    bfloat16 goes there only on a CPU with AMX-BF16, whose tiles oneDNN multiplies on under SDPA; without
    them SDPA is behind the kernel at every length (module docstring)."""
    if dtype == torch.bfloat16 and "amx_bf16" not in cpu_flags:
        return None
    return SDPA_MIN_TOKENS.get(dtype)


@dataclass
class CpuAttentionMetadata:
    """One step's batch in the form the kernel reads (all CPU, contiguous; ``batch_args`` and ``run_args``
    hold these tensors' addresses, so the tensors are read, never replaced)."""

    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_tables: torch.Tensor  # int32 [num_reqs, width], rows contiguous
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    num_reqs: int
    num_tokens: int
    fresh_prompts: tuple[tuple[int, int], ...] = ()  # query ranges [start, end) that go to SDPA or AMX ...
    kernel_runs: tuple[tuple[int, int], ...] = ()  # ... and the requests [first, last) that go to the kernel
    # the kernel's batch arguments (query_start_loc .. num_reqs) with the run's first request: for the whole
    # batch, and for each of kernel_runs
    batch_args: tuple = ()
    run_args: tuple = ()
    fresh_amx: torch.Tensor | None = None  # int32 [len(fresh_prompts), 2] when they go to the AMX call


def _int_tensor(t: torch.Tensor, dtype: torch.dtype, field: str) -> torch.Tensor:
    if t.device.type != "cpu":
        raise ValueError(f"cpu attention: batch.{field} must be on the CPU, got a tensor on {t.device}")
    return t.to(dtype).contiguous()


class CpuAttentionBackend(DenseKVCache):
    """Paged attention on CPU through a C++ kernel.  Factory: ``CpuAttentionBackend(spec)``."""

    name: ClassVar[str] = "cpu"
    capabilities: ClassVar[AttentionCapabilities] = CPU_CAPABILITIES

    def __init__(self, spec: AttentionSpec) -> None:
        reasons = self.capabilities.check(spec)
        lib, lib_reasons = kernels.load()
        if reasons or lib is None:
            raise UnsupportedError(IMPLEMENTATION, reasons + lib_reasons)
        self.spec = spec
        self.lib = lib
        self.scale = float(spec.softmax_scale)
        self.soft_cap = float(spec.logits_soft_cap or 0.0)  # 0: none
        # per layer, 0: full; (): every layer full. Read once here, not from spec.sliding_window(layer) in each
        # layer's forward: that call put the protocol module back on every decode step's path
        self._windows = tuple(w or 0 for w in spec.sliding_windows)
        self._dtype_code = DTYPE_CODES[spec.dtype]
        self._kv_code = KV_TYPE_CODES[spec.kv_cache_dtype]
        self._storage = kv_quant.storage_dtype(spec)
        self._row = kv_quant.row_size(spec)
        self._elem_size = torch.empty((), dtype=self._storage).element_size()
        self._err = (ctypes.c_int64 * 4)()
        self._err_ptr = ctypes.addressof(self._err)
        # the kernel's arguments fixed by the spec: before the window (num_heads .. scale) and after it
        self._shape_args = (spec.num_heads, spec.num_kv_heads, spec.head_size, spec.block_size, self.scale)
        self._value_args = (self.soft_cap, self._kv_code, *spec.kv_scales)
        # bfloat16 fresh prompts through csrc/prefill_amx.cpp (module docstring)
        self.amx_prefill = bool(
            spec.dtype == torch.bfloat16 and spec.head_size in AMX_HEAD_SIZES and lib.corerun_cpu_prefill_amx_available()
        )
        self.sdpa_min_tokens = sdpa_min_tokens(spec.dtype, kernels.cpu_flags())
        logger.info(
            "cpu attention: %s, %d/%d heads of size %d, block size %d, %s",
            dtype_name(spec.dtype), spec.num_heads, spec.num_kv_heads, spec.head_size, spec.block_size,
            "OpenMP" if lib.corerun_cpu_openmp() else "single-threaded (built without OpenMP)",
        )

    # ------------------------------------------------------------------- cache
    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """Zeroed ``[2, num_blocks, block_size, num_kv_heads, row]`` at the stored dtype (row: head_size, int8 + 2)."""
        s = self.spec
        return zeros_kv_cache((2, num_blocks, s.block_size, s.num_kv_heads, self._row), self._storage)

    def kv_cache_view(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._cache_parts(kv_cache)
        return kv_quant.values_view(k, self.spec), kv_quant.values_view(v, self.spec)

    # ---------------------------------------------------------------- per step
    def plan(self, batch: AttentionBatch) -> CpuAttentionMetadata:
        md = CpuAttentionMetadata(
            query_start_loc=_int_tensor(batch.query_start_loc, torch.int32, "query_start_loc"),
            seq_lens=_int_tensor(batch.seq_lens, torch.int32, "seq_lens"),
            block_tables=_int_tensor(batch.block_tables, torch.int32, "block_tables"),
            slot_mapping=_int_tensor(batch.slot_mapping, torch.int64, "slot_mapping"),
            num_reqs=batch.num_reqs,
            num_tokens=batch.num_tokens,
        )
        fresh_min = AMX_MIN_TOKENS if self.amx_prefill else self.sdpa_min_tokens
        if fresh_min is not None and batch.max_query_len >= fresh_min and not self.soft_cap and not self._kv_code:
            self._plan_fresh_prompts(md, fresh_min)
            if self.amx_prefill and md.fresh_prompts:
                md.fresh_amx = torch.tensor(md.fresh_prompts, dtype=torch.int32).reshape(-1, 2)
        md.batch_args = self._batch_args(md, 0, md.num_reqs)
        md.run_args = tuple(self._batch_args(md, first, last) for first, last in md.kernel_runs)
        return md

    @staticmethod
    def _batch_args(md: CpuAttentionMetadata, first: int, last: int) -> tuple:
        """``(first, the kernel's arguments query_start_loc .. num_reqs for requests first .. last - 1)``."""
        bt, i32 = md.block_tables, md.seq_lens.element_size()
        return first, (md.query_start_loc.data_ptr() + first * i32, md.seq_lens.data_ptr() + first * i32,
                       bt.data_ptr() + first * bt.stride(0) * i32, bt.stride(0), bt.shape[1], last - first)

    def _plan_fresh_prompts(self, md: CpuAttentionMetadata, fresh_min: int) -> None:
        """Hand the step's fresh prompts (module docstring) to SDPA or AMX, the runs of requests between them to the kernel."""
        qsl, lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
        if len(qsl) != md.num_reqs + 1 or len(lens) != md.num_reqs or qsl[0] < 0 or qsl[-1] > md.num_tokens:
            return  # the kernel explains the mismatch
        fresh = [lens[i] == qsl[i + 1] - qsl[i] >= fresh_min for i in range(md.num_reqs)]
        if not any(fresh):
            return
        runs, first = [], 0
        for i, f in enumerate(fresh + [True]):
            if f:
                if first < i:
                    runs.append((first, i))
                first = i + 1
        md.fresh_prompts = tuple((qsl[i], qsl[i + 1]) for i, f in enumerate(fresh) if f)
        md.kernel_runs = tuple(runs)

    def _cache_parts(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._cache_args(kv_cache)
        return kv_cache[0], kv_cache[1]

    def _cache_args(self, kv_cache: torch.Tensor) -> tuple[int, int, int, int, int, int]:
        """The checked cache as the kernels take it: K and V addresses, block / token / head strides, blocks."""
        s = self.spec
        if (
            kv_cache.dim() != 5 or kv_cache.shape[0] != 2
            or tuple(kv_cache.shape[2:]) != (s.block_size, s.num_kv_heads, self._row)
            or kv_cache.dtype != self._storage or kv_cache.device.type != "cpu" or kv_cache.stride(-1) != 1
        ):
            raise ValueError(
                f"cpu attention: kv_cache must be a CPU {dtype_name(self._storage)} tensor [2, num_blocks, {s.block_size}, "
                f"{s.num_kv_heads}, {self._row}] with a contiguous last dimension, got {dtype_name(kv_cache.dtype)} "
                f"{list(kv_cache.shape)} on {kv_cache.device}"
            )
        st = kv_cache.stride()
        k = kv_cache.data_ptr()
        return k, k + st[0] * kv_cache.element_size(), st[1], st[2], st[3], kv_cache.shape[1]

    def _rows(self, t: torch.Tensor, heads: int, field: str) -> torch.Tensor:
        """``t`` as ``[tokens, heads, head_size]`` in the cache's dtype on the CPU, last dimension contiguous."""
        s = self.spec
        if t.dim() != 3 or t.shape[1:] != (heads, s.head_size) or t.device.type != "cpu":
            raise ValueError(
                f"cpu attention: {field} must be a CPU tensor [num_tokens, {heads}, {s.head_size}], "
                f"got {list(t.shape)} on {t.device}"
            )
        if t.dtype != s.dtype or t.stride(-1) != 1:
            t = t.to(s.dtype).contiguous()
        return t

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        s = self.spec
        self._write(self._rows(key, s.num_kv_heads, "key"), self._rows(value, s.num_kv_heads, "value"),
                    self._cache_args(kv_cache), _int_tensor(slot_mapping, torch.int64, "slot_mapping"))

    def _write(self, key: torch.Tensor, value: torch.Tensor, cache: tuple[int, int, int, int, int, int],
               slots: torch.Tensor) -> None:
        """:meth:`write_kv` of ``key``/``value`` as :meth:`_rows` makes them into the cache as :meth:`_cache_args`
        describes it; ``slots`` int64, contiguous, on the CPU (as :meth:`plan` makes them)."""
        s = self.spec
        if self._kv_code:  # quantized rows, copied as bytes
            key, value = kv_quant.quantize(key, s, 0), kv_quant.quantize(value, s, 1)
        n = slots.shape[0]
        if key.shape[0] != n or value.shape[0] != n:
            raise ValueError(
                f"cpu attention: key {list(key.shape)} / value {list(value.shape)} must have one row per "
                f"slot_mapping entry ({n})"
            )
        if n == 0:
            return
        k_st, v_st = key.stride(), value.stride()

        def refused(rc: int) -> None:
            _, token, slot, num_slots = list(self._err)
            raise ValueError(
                f"cpu attention: slot_mapping[{token}] = {slot} is outside the cache (valid: -1 for none, or "
                f"0 .. {num_slots - 1} for {cache[5]} blocks of {s.block_size}); nothing was written"
            )

        native(
            self.lib.corerun_cpu_write_kv,
            self._elem_size, key.data_ptr(), k_st[0], k_st[1], value.data_ptr(), v_st[0], v_st[1], *cache[:5],
            slots.data_ptr(), n, s.num_kv_heads, self._row, s.block_size, cache[5], self._err_ptr, check=refused,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: CpuAttentionMetadata,
        out: torch.Tensor | None = None,
        *,
        layer: int = 0,
    ) -> torch.Tensor:
        """Write this step's K/V, then attend over the paged cache (layer ``layer``'s sliding window, if any).

        ``query`` ``[num_tokens, num_heads, head_size]``, ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]``
        -> ``[num_tokens, num_heads, head_size]`` (into ``out`` when given).
        """
        s = self.spec
        cache = self._cache_args(kv_cache)
        key, value = self._rows(key, s.num_kv_heads, "key"), self._rows(value, s.num_kv_heads, "value")
        self._write(key, value, cache, metadata.slot_mapping)  # (the slots as plan converted them)
        q = self._rows(query, s.num_heads, "query")
        if out is None:
            out = torch.empty(q.shape, dtype=s.dtype)
        target = out if out.dtype == s.dtype and out.stride(-1) == 1 and out.device.type == "cpu" else torch.empty(q.shape, dtype=s.dtype)
        if tuple(target.shape) != tuple(q.shape):
            raise ValueError(f"cpu attention: out must have the query's shape {list(q.shape)}, got {list(target.shape)}")
        md = metadata
        window = self._windows[layer] if self._windows else 0
        fresh = md.fresh_prompts if not window else ()
        if fresh:
            if md.fresh_amx is None or not self._attend_fresh_amx(q, key, value, target, md.fresh_amx):
                self._attend_fresh(q, key, value, target, fresh)
        for run in md.run_args if fresh else (md.batch_args,):
            self._attend_paged(q, cache, target, md, window, run)
        if target is not out:
            out.copy_(target)
        return out

    def _attend_fresh(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, target: torch.Tensor,
                      ranges: tuple[tuple[int, int], ...]) -> None:
        """Causal attention of each prompt ``[start, end)`` over its own K/V through torch's SDPA."""
        for start, end in ranges:
            o = torch.nn.functional.scaled_dot_product_attention(
                q[start:end].transpose(0, 1).unsqueeze(0), k[start:end].transpose(0, 1).unsqueeze(0),
                v[start:end].transpose(0, 1).unsqueeze(0), is_causal=True, scale=self.scale,
                enable_gqa=self.spec.num_heads != self.spec.num_kv_heads,
            )
            target[start:end].copy_(o[0].transpose(0, 1))

    def _attend_fresh_amx(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, target: torch.Tensor,
                          ranges: torch.Tensor) -> bool:
        """Every fresh prompt (``ranges`` int32 ``[n, 2]``) in one call of ``csrc/prefill_amx.cpp``; False when the
        library has no AMX path after all (the caller then takes the SDPA route)."""
        s = self.spec
        q_st, k_st, v_st, o_st = q.stride(), k.stride(), v.stride(), target.stride()
        rc = self.lib.corerun_cpu_prefill_amx(
            q.data_ptr(), q_st[0], q_st[1], k.data_ptr(), k_st[0], k_st[1], v.data_ptr(), v_st[0], v_st[1],
            target.data_ptr(), o_st[0], o_st[1], ranges.data_ptr(), ranges.shape[0], q.shape[0],
            s.num_heads, s.num_kv_heads, s.head_size, self.scale, torch.get_num_threads(), self._err_ptr,
        )
        if rc == AMX_NO_AMX:
            self.amx_prefill = False  # later steps plan for SDPA
            return False
        if rc:
            _, a, b, c = list(self._err)
            why = {
                1: f"fresh prompt {a}'s query range [{b}, {c}) is not within the step's {q.shape[0]} tokens",
                5: (f"head_size {b} is not one of {AMX_HEAD_SIZES} (or the scale {self.scale} is not positive)" if a == 0
                    else f"num_heads {b} is not a multiple of num_kv_heads {c}"),
                6: "out of memory for the repacked K/V",
            }.get(rc, f"code {rc} ({a}, {b}, {c})")
            raise ValueError(f"cpu attention: the AMX prefill call refused the step: {why}")
        return True

    def _attend_paged(self, q: torch.Tensor, cache: tuple[int, int, int, int, int, int], target: torch.Tensor,
                      md: CpuAttentionMetadata, window: int, run: tuple) -> None:
        """The C++ kernel over the paged cache for one run of the step's requests (``run``: its first
        request and batch arguments, as :meth:`plan` made them; their ``query_start_loc`` entries index
        the whole step's query)."""
        first, batch = run
        q_st, o_st = q.stride(), target.stride()

        def refused(rc: int) -> None:
            if rc <= 4:
                self._err[1] += first  # the request's index in the whole step
            raise ValueError(self._explain(rc, md, cache[5]))

        native(
            self.lib.corerun_cpu_attention,
            self._dtype_code, q.data_ptr(), q_st[0], q_st[1], *cache[:5], target.data_ptr(), o_st[0], o_st[1],
            *batch, q.shape[0], cache[5], *self._shape_args, window, *self._value_args,
            torch.get_num_threads(), self._err_ptr, check=refused, threads_at=-2,
        )

    def _explain(self, rc: int, md: CpuAttentionMetadata, num_blocks: int) -> str:
        _, a, b, c = list(self._err)
        if rc == 1:
            return (f"cpu attention: query_start_loc[{a}:{a + 2}] = [{b}, {c}] is not a non-decreasing range "
                    f"within the step's {md.num_tokens} tokens")
        if rc == 2:
            return f"cpu attention: seq_lens[{a}] = {b} is shorter than request {a}'s {c} query tokens"
        if rc == 3:
            return (f"cpu attention: request {a} needs {b} blocks of {self.spec.block_size} tokens, but block_tables "
                    f"has {c} columns")
        if rc == 4:
            return (f"cpu attention: block_tables[{a}, {b}] = {c} is not a block of this cache "
                    f"(valid: 0 .. {num_blocks - 1})")
        return f"cpu attention: the kernel refused the call (code {rc}, detail {a}, {b}, {c})"
