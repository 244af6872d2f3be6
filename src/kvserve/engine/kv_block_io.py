"""The K/V of whole device blocks as CPU tensors and bytes, and back into device blocks.

Prefill/decode transfer and the host/storage tiers move KV between processes and
machines, so the bytes must mean the same thing at both ends. They are defined here once.

Layout
------
One block is ``[num_layers, block_size, 2 * num_kv_heads, head_dim]`` of the pool's
dtype, C-contiguous: layer 0 first; within a layer token slot 0 first; within a slot the
K heads then the V heads (the pool's own per-layer layout, see
:class:`~kvserve.engine.kv_pool.KVPool`). A run of ``n`` blocks is ``n`` such blocks one
after the other (``[n, num_layers, ...]``), so block ``i`` of a run is the byte range
``[i * block_nbytes, (i + 1) * block_nbytes)`` and can be stored or sent on its own.
Bytes are in the machine's byte order, which is part of the layout.

A :class:`KVBlockLayout` names the model and every dimension; its :meth:`tag` is the
string a storage namespace or a transfer handshake carries, and bytes whose layout
differs from the receiver's are refused (:class:`KVLayoutMismatch`), never installed.
:func:`pack` / :func:`unpack` make self-describing buffers (header + payload).
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import orjson
import torch

from kvserve.engine.kv_pool import KVPool

_PACK_MAGIC = b"KVB1"
_PACK_PREFIX = struct.Struct("<4sI")  # magic, header length


class KVLayoutMismatch(ValueError):
    """KV bytes were made for another model, shape, dtype or byte order."""


@dataclass(frozen=True, slots=True)
class KVBlockLayout:
    model: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the module: "float32", "bfloat16", ...
    byteorder: str = sys.byteorder

    @classmethod
    def of_runner(cls, runner: Any, model: str) -> KVBlockLayout:
        """The layout of a :class:`~kvserve.engine.model_runner.ModelRunner`'s pool."""
        config = runner.config
        return cls(
            model=model,
            num_layers=config.num_layers,
            block_size=runner.block_size,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=str(runner.dtype).removeprefix("torch."),
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise KVLayoutMismatch(f"unknown dtype {self.dtype!r}")
        return dtype

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.block_size, 2 * self.num_kv_heads, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        element_size = torch.empty((), dtype=self.torch_dtype).element_size()
        layers, slots, heads, dim = self.block_shape
        return layers * slots * heads * dim * element_size

    def tag(self) -> str:
        """Canonical text naming this layout, equal across processes for equal layouts."""
        return (
            f"kvserve-kv/1 model={self.model} layers={self.num_layers} "
            f"block={self.block_size} kv_heads={self.num_kv_heads} head_dim={self.head_dim} "
            f"dtype={self.dtype} order={self.byteorder}"
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, fields: Any) -> KVBlockLayout:
        try:
            return cls(**fields)
        except TypeError as exc:
            raise KVLayoutMismatch(f"not a KV layout: {fields!r}") from exc

    def require_same(self, other: KVBlockLayout) -> None:
        if other != self:
            raise KVLayoutMismatch(f"KV layout {other.tag()!r} does not match {self.tag()!r}")


def read_blocks(pool: KVPool, layout: KVBlockLayout, block_ids: Sequence[int]) -> torch.Tensor:
    """A contiguous CPU copy ``[len(block_ids), *layout.block_shape]`` of the blocks' K/V.

    Run it where nothing writes the pool meanwhile (the engine thread, between steps).
    """
    index = _block_index(pool, block_ids)
    per_layer = [pool.layer(layer).index_select(0, index) for layer in range(layout.num_layers)]
    return torch.stack(per_layer, dim=1).to("cpu").contiguous()


def write_blocks(
    pool: KVPool, layout: KVBlockLayout, block_ids: Sequence[int], blocks: torch.Tensor
) -> None:
    """Install ``blocks`` (as :func:`read_blocks` returns them) into ``block_ids``."""
    expected = (len(block_ids), *layout.block_shape)
    if tuple(blocks.shape) != expected or blocks.dtype != layout.torch_dtype:
        raise KVLayoutMismatch(
            f"blocks are {tuple(blocks.shape)} {blocks.dtype}, expected {expected} "
            f"{layout.torch_dtype}"
        )
    index = _block_index(pool, block_ids)
    for layer in range(layout.num_layers):
        target = pool.layer(layer)
        target.index_copy_(0, index, blocks[:, layer].to(target.device))


def to_bytes(blocks: torch.Tensor) -> bytes:
    """The raw payload of :func:`read_blocks`' result, in the documented layout."""
    return payload_view(blocks).tobytes()


def payload_view(blocks: torch.Tensor) -> memoryview:
    """The same bytes as :func:`to_bytes` without a copy (valid while ``blocks`` lives),
    for writing straight to a socket or file."""
    array: Any = blocks.contiguous().view(torch.uint8).numpy()  # numpy arrays are buffers
    return memoryview(array).cast("B")


def from_bytes(layout: KVBlockLayout, data: bytes | bytearray | memoryview) -> torch.Tensor:
    """The blocks in a raw payload (any whole number of blocks of ``layout``)."""
    num_blocks, remainder = divmod(len(data), layout.block_nbytes)
    if remainder:
        raise KVLayoutMismatch(
            f"{len(data)} bytes is not a whole number of {layout.block_nbytes}-byte blocks"
        )
    if not num_blocks:
        return torch.empty((0, *layout.block_shape), dtype=layout.torch_dtype)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(layout.torch_dtype).reshape(num_blocks, *layout.block_shape)


def pack(layout: KVBlockLayout, blocks: torch.Tensor) -> bytes:
    """``magic, header length, JSON header (layout + block count), payload``."""
    header = orjson.dumps({"layout": layout.to_json(), "num_blocks": blocks.shape[0]})
    return _PACK_PREFIX.pack(_PACK_MAGIC, len(header)) + header + to_bytes(blocks)


def unpack(layout: KVBlockLayout, data: bytes | bytearray | memoryview) -> torch.Tensor:
    """The blocks of a :func:`pack` buffer; refuses any other layout or a cut buffer."""
    view = memoryview(data)
    if len(view) < _PACK_PREFIX.size:
        raise KVLayoutMismatch("buffer too short for a KV block header")
    magic, header_len = _PACK_PREFIX.unpack_from(view)
    if magic != _PACK_MAGIC:
        raise KVLayoutMismatch(f"not a packed KV buffer (magic {magic!r})")
    start = _PACK_PREFIX.size + header_len
    try:
        header = orjson.loads(view[_PACK_PREFIX.size : start])
        sent_layout = KVBlockLayout.from_json(header["layout"])
        num_blocks = int(header["num_blocks"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise KVLayoutMismatch(f"bad KV block header: {exc}") from exc
    layout.require_same(sent_layout)
    payload = view[start:]
    if len(payload) != num_blocks * layout.block_nbytes:
        raise KVLayoutMismatch(
            f"payload of {len(payload)} bytes for {num_blocks} blocks of {layout.block_nbytes}"
        )
    return from_bytes(layout, payload)


def _block_index(pool: KVPool, block_ids: Sequence[int]) -> torch.Tensor:
    if any(not 0 <= b < pool.num_blocks for b in block_ids):
        raise IndexError(f"block ids {list(block_ids)} outside [0, {pool.num_blocks})")
    device = pool.layer(0).device
    return torch.tensor(list(block_ids), dtype=torch.long, device=device)
