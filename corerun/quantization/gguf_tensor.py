"""A GGUF tensor as stored: packed blocks, their GGML type and the logical shape.

Weight loaders receive it in place of a float tensor.  It cuts like a tensor (``narrow`` on rows, or
on columns at block boundaries) so that merged and tensor-parallel loads slice it before it is
stored; a parameter that keeps float values takes ``dequantize()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from corerun.quantization.gguf_blocks import LAYOUTS, dequantize


class GGUFLoadError(ValueError):
    """A GGUF tensor that cannot be read or cut as asked; the message names the tensor and its type."""


@dataclass(frozen=True)
class GGUFTensor:
    """``data`` uint8 ``[rows, cols // block_size * type_size]`` of GGML type ``type_name``, logically ``[rows, cols]``."""

    name: str  # the tensor's name in the GGUF file, for errors
    type_name: str
    data: torch.Tensor
    cols: int

    def __post_init__(self) -> None:
        layout = LAYOUTS.get(self.type_name)
        if layout is None:
            raise GGUFLoadError(
                f"GGUF tensor {self.name}: type {self.type_name} is not read by corerun; it reads {', '.join(LAYOUTS)}"
            )
        if self.cols % layout.block_size:
            raise GGUFLoadError(
                f"GGUF tensor {self.name} ({self.type_name}): {self.cols} columns is not a multiple of the "
                f"block size {layout.block_size}"
            )
        want = self.cols // layout.block_size * layout.type_size
        if self.data.dim() != 2 or self.data.dtype != torch.uint8 or self.data.shape[1] != want:
            raise GGUFLoadError(
                f"GGUF tensor {self.name} ({self.type_name}): expected uint8 data [rows, {want}] for {self.cols} "
                f"columns, got {self.data.dtype} {list(self.data.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.cols))

    @property
    def layout(self):  # noqa: ANN201
        return LAYOUTS[self.type_name]

    def narrow(self, dim: int, start: int, length: int) -> "GGUFTensor":
        """Rows ``[start, start + length)`` (``dim`` 0), or columns (``dim`` 1) on block boundaries."""
        if dim == 0:
            return GGUFTensor(self.name, self.type_name, self.data.narrow(0, start, length), self.cols)
        block = self.layout.block_size
        if start % block or length % block:
            raise GGUFLoadError(
                f"GGUF tensor {self.name} ({self.type_name}): columns [{start}, {start + length}) do not fall on its "
                f"blocks of {block}; a tensor-parallel split of its input features needs multiples of {block} per rank"
            )
        size = self.layout.type_size
        return GGUFTensor(self.name, self.type_name, self.data.narrow(1, start // block * size, length // block * size), length)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values, ``[rows, cols]`` in ``dtype``."""
        return dequantize(self.data, self.type_name, self.cols, dtype)


def as_dense(loaded: "torch.Tensor | GGUFTensor") -> torch.Tensor:
    """``loaded`` as float values: a packed tensor dequantized, a plain one as it is."""
    return loaded.dequantize() if isinstance(loaded, GGUFTensor) else loaded
