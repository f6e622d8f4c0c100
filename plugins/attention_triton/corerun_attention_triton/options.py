"""Options of the ``triton`` backend (``attention: {name: triton, options: {num_splits: 4}}``)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from corerun_attention_triton.split_rule import MAX_SPLITS


class TritonAttentionOptions(BaseModel):
    """``num_splits``: ``"auto"`` applies the split-KV rule; ``1`` never splits; ``N > 1`` always
    splits every decode's keys into ``N`` slices (flash-decoding)."""

    model_config = ConfigDict(extra="forbid")

    num_splits: Union[Literal["auto"], Annotated[int, Field(ge=1, le=MAX_SPLITS)]] = "auto"
