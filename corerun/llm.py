"""``LLM``: the offline API, shaped like vLLM's so its users feel at home."""

from __future__ import annotations

import os
from contextlib import closing
import time
from typing import Any, Iterator, Sequence as Seq

from corerun.config import Config, deep_merge, load_config
from corerun.engine.llm_engine import LLMEngine, Prompt
from corerun.errors import RequestError
from corerun.outputs import RequestOutput
from corerun.sampling_params import SamplingParams

ParamsArg = SamplingParams | Seq[SamplingParams] | None


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

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop what this engine runs outside the process (tensor-parallel workers). Safe to call twice."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---------------------------------------------------------------- batch
    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: ParamsArg = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        Every request is validated before any runs: a bad one raises RequestError naming its index,
        and nothing is queued.
        """
        ids = self._add(prompts, sampling_params)
        total = len(ids)
        show = use_tqdm if use_tqdm is not None else total > 1
        bar = _progress(total) if show else None
        engine = self.engine
        start, tokens0 = time.perf_counter(), engine.num_generated_tokens
        done: dict[str, RequestOutput] = {}
        try:
            with closing(self._drive(ids)) as steps:  # closing: abort the rest at once if this loop raises
                for seq in steps:
                    if seq.is_finished:
                        done[seq.request_id] = engine.output(seq)
                        if bar is not None:
                            bar.update(1)
                    if bar is not None:
                        elapsed = max(time.perf_counter() - start, 1e-9)
                        bar.set_postfix_str(f"{(engine.num_generated_tokens - tokens0) / elapsed:.1f} tok/s", refresh=False)
        finally:
            if bar is not None:
                bar.close()
        return [done[r] for r in ids]

    # ------------------------------------------------------------ streaming
    def stream(self, prompts: Prompt | Seq[Prompt], sampling_params: ParamsArg = None) -> Iterator[RequestOutput]:
        """Yield a cumulative ``RequestOutput`` each time a request gets a token (``finished`` on its last).

        Closing the iterator early aborts the requests still running and frees their blocks.
        """
        with closing(self._drive(self._add(prompts, sampling_params))) as steps:
            for seq in steps:
                yield self.engine.output(seq)

    def _drive(self, ids: list[str]) -> Iterator[Any]:
        """Step the engine until the requests ``ids`` finish, yielding each of their sequences that got a
        token or finished; finished ones are released after the caller has seen them, and those still
        pending when the caller stops (or an error escapes) are aborted, their blocks freed."""
        engine = self.engine
        pending = set(ids)
        try:
            while pending:
                touched = engine.step()
                if not touched and not engine.has_unfinished_requests():
                    break
                for seq in touched:
                    if seq.request_id in pending:
                        yield seq
                        if seq.is_finished:
                            pending.discard(seq.request_id)
                            engine.release(seq.request_id)
        finally:
            for rid in pending:
                engine.abort(rid)
                engine.release(rid)

    def _add(self, prompts: Prompt | Seq[Prompt], sampling_params: ParamsArg) -> list[str]:
        plist = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, (SamplingParams, dict)):
            params_list = [sampling_params] * len(plist)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(plist):
                raise RequestError(
                    f"sampling_params has {len(params_list)} entries but there are {len(plist)} prompts; "
                    "give one SamplingParams for all, or one per prompt"
                )
        seqs = []
        for i, (p, sp) in enumerate(zip(plist, params_list)):
            try:
                seqs.append(self.engine.make_sequence(p, sp))
            except (RequestError, ValueError) as exc:
                raise RequestError(f"prompt {i}: {exc}") from None
        for seq in seqs:
            self.engine.requests[seq.request_id] = seq
            self.engine.scheduler.add(seq)
        return [s.request_id for s in seqs]


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
