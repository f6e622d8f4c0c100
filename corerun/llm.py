"""``LLM``: the offline API, shaped like vLLM's so its users feel at home."""

from __future__ import annotations

import os
import time
from typing import Any, Iterator, Sequence as Seq

from corerun.config import Config, deep_merge, load_config
from corerun.engine.llm_engine import LLMEngine, Prompt
from corerun.engine.loop import EngineLoop, OutputQueue
from corerun.engine.pooling import ModelPooling, embedding_params, read_model_pooling
from corerun.errors import RequestError
from corerun.lora.request import LoRARequest
from corerun.outputs import EmbeddingRequestOutput, RequestOutput
from corerun.sampling_params import SamplingParams

ParamsArg = SamplingParams | Seq[SamplingParams] | None
LoRAArg = LoRARequest | Seq[LoRARequest | None] | None


class LLM:
    """Load a model with the configured plugins and generate.

    ``LLM(model=None, config=None, **overrides)``: ``config`` is a YAML path or a :class:`Config`;
    ``overrides`` are the config's own keys (``attention="triton"``, ``kv_cache={"block_size": 32}``).
    With no model the built-in default model (SmolLM2-135M-Instruct) is used.
    """

    def __init__(self, model: str | os.PathLike[str] | None = None, config: str | os.PathLike[str] | Config | None = None, **overrides: Any) -> None:
        if model is not None:
            overrides["model"] = str(model)
        if isinstance(config, Config):
            merged = config.model_dump()
            cfg = load_config(None, overrides=deep_merge(merged, overrides)) if overrides else config
        else:
            cfg = load_config(config, overrides=overrides)
        self.config = cfg
        self.engine = LLMEngine(cfg)
        try:  # how the model pools, read at load: a pooling corerun lacks is refused here, naming its file
            self.model_pooling: ModelPooling = read_model_pooling(self.engine.runner.model_dir)
        except Exception:
            self.engine.shutdown()
            raise
        self.engine_loop = EngineLoop(self.engine)  # the one loop every caller's requests join

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Abort what is still in flight, stop the engine loop and what runs outside the process
        (tensor-parallel workers). Safe to call twice."""
        self.engine_loop.shutdown()
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def abort(self, request_id: str | Seq[str]) -> None:
        """End a request (or several) as ``abort`` and free its blocks, from any thread, whether it is
        waiting or running; its ``generate``/``stream`` caller gets the ``abort`` output. Finished and
        unknown ids are ignored."""
        self.engine_loop.abort([request_id] if isinstance(request_id, str) else list(request_id))

    # ---------------------------------------------------------------- batch
    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: ParamsArg = None,
        use_tqdm: bool | None = None,
        lora_request: LoRAArg = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        ``lora_request``: the adapter every prompt runs under, or one per prompt (``None``: the base
        model); the engine needs ``lora: {enabled: true}`` (docs/lora.md).

        Every request is validated before any runs: a bad one raises RequestError naming its index,
        and nothing is queued. Safe to call from several threads at once: all requests share the
        engine loop, each caller gets its own outputs.
        """
        outputs = OutputQueue()
        ids = self._add(prompts, sampling_params, outputs, final_only=True, lora_request=lora_request)
        total = len(ids)
        show = use_tqdm if use_tqdm is not None else total > 1
        bar = _progress(total) if show else None
        engine = self.engine
        start, tokens0 = time.perf_counter(), engine.num_generated_tokens
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < total:
                out = outputs.get()
                done[out.request_id] = out
                if bar is not None:
                    bar.update(1)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"{(engine.num_generated_tokens - tokens0) / elapsed:.1f} tok/s", refresh=False)
        finally:
            if len(done) < total:  # interrupted (Ctrl-C) or the loop failed: abort the rest at once
                self.engine_loop.abort([r for r in ids if r not in done])
            if bar is not None:
                bar.close()
        return [done[r] for r in ids]

    # ------------------------------------------------------------ embeddings
    def embed(self, prompts: Prompt | Seq[Prompt], dimensions: int | None = None) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (text or token ids), in prompt order: ``outputs[i].outputs.embedding``.

        Pooled as the model's folder says (:func:`corerun.engine.pooling.read_model_pooling`: its
        sentence-transformers files, else the last token, normalised); ``dimensions`` keeps the first
        values of each vector, for models trained for it (Matryoshka), and is refused otherwise.  The
        prompts are computed like generation prompts, beside whatever else is running, and nothing is sampled.
        """
        params = embedding_params(self.model_pooling, dimensions)
        plist = _as_prompt_list(prompts)
        outputs = OutputQueue()
        ids = self.engine_loop.add_requests(plist, [params] * len(plist), outputs, final_only=True)
        done: dict[str, EmbeddingRequestOutput] = {}
        try:
            while len(done) < len(ids):
                out = outputs.get()
                done[out.request_id] = out
        finally:
            if len(done) < len(ids):
                self.engine_loop.abort([r for r in ids if r not in done])
        return [done[r] for r in ids]

    # ------------------------------------------------------------ streaming
    def stream(self, prompts: Prompt | Seq[Prompt], sampling_params: ParamsArg = None,
               lora_request: LoRAArg = None) -> Iterator[RequestOutput]:
        """Yield a cumulative ``RequestOutput`` each time a request gets a token (``finished`` on its last).

        Closing the iterator early aborts the requests still running and frees their blocks. Outputs
        wait in the iterator's own queue while it is not read, so pausing it loses nothing.
        """
        outputs = OutputQueue()
        ids = self._add(prompts, sampling_params, outputs, final_only=False, lora_request=lora_request)
        pending = set(ids)
        try:
            while pending:
                out = outputs.get()
                if out.finished:
                    pending.discard(out.request_id)
                yield out
        finally:
            if pending:
                self.engine_loop.abort(list(pending))

    def _add(self, prompts: Prompt | Seq[Prompt], sampling_params: ParamsArg, outputs: OutputQueue,
             final_only: bool, lora_request: LoRAArg = None) -> list[str]:
        plist = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, (SamplingParams, dict)):
            params_list = [sampling_params] * len(plist)
        elif isinstance(sampling_params, (str, bytes)) or not hasattr(sampling_params, "__len__"):
            raise RequestError(
                f"sampling_params must be a SamplingParams, a dict of its fields, or a list of them (one per "
                f"prompt), got {type(sampling_params).__name__} {_short(sampling_params)}"
            )
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(plist):
                raise RequestError(
                    f"sampling_params has {len(params_list)} entries but there are {len(plist)} prompts; "
                    "give one SamplingParams for all, or one per prompt"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(plist)
        elif isinstance(lora_request, (str, bytes)) or not hasattr(lora_request, "__len__"):
            raise RequestError(f"lora_request must be a LoRARequest, None, or a list of them (one per prompt), "
                               f"got {type(lora_request).__name__} {_short(lora_request)}")
        else:
            loras = list(lora_request)
            if len(loras) != len(plist):
                raise RequestError(f"lora_request has {len(loras)} entries but there are {len(plist)} prompts; "
                                   "give one LoRARequest for all, or one per prompt")
        return self.engine_loop.add_requests(plist, params_list, outputs, final_only=final_only, lora_requests=loras)


def _short(value: Any) -> str:
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


def _as_prompt_list(prompts: Any) -> list[Prompt]:
    """One prompt (text, token ids, ``{"prompt_token_ids": ...}``, a 1-D array) or a list of them -> a list of prompts.

    A flat list holding no string, list, dict or array is one prompt of token ids, so that a bad
    element (``[1, 2.5]``) is reported as a bad token of that prompt.
    """
    if isinstance(prompts, (str, bytes, dict)) or not hasattr(prompts, "__iter__"):
        return [prompts]  # (a non-iterable is refused, by index, when validated)
    if hasattr(prompts, "tolist"):  # numpy array / torch tensor: 1-D is one prompt, 2-D a batch
        prompts = prompts.tolist()
        if not isinstance(prompts, list):
            return [prompts]
    plist = list(prompts)
    if plist and not any(_is_prompt(p) for p in plist):
        return [plist]  # one prompt given as token ids
    return plist


def _is_prompt(p: Any) -> bool:
    if isinstance(p, (str, bytes, dict, list, tuple)):
        return True
    return getattr(p, "ndim", 0) >= 1  # an array or tensor of token ids


def _progress(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req", dynamic_ncols=True)
