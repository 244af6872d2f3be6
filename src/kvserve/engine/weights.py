"""Reading a checkpoint's tensors from ``*.safetensors`` files, single or sharded."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvserve.model_folder.config import read_json
from kvserve.model_folder.errors import ModelLoadError

_INDEX_NAME = "model.safetensors.index.json"


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The shard files: those named by the index when there is one (so stray files in the
    folder are ignored), else every ``*.safetensors`` file."""
    index_path = model_dir / _INDEX_NAME
    if index_path.is_file():
        weight_map = read_json(index_path, what=_INDEX_NAME).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path}: no weight_map")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"weight shard {file.name} named in {_INDEX_NAME} not found")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in model folder {model_dir}")
    return files


class CheckpointTensors:
    """Name → tensor for a whole checkpoint, cast to one dtype and device on read."""

    def __init__(self, model_dir: str | Path, *, dtype: torch.dtype, device: torch.device) -> None:
        self._dtype = dtype
        self._device = device
        self._tensors: dict[str, torch.Tensor] = {}
        for file in checkpoint_files(Path(model_dir)):
            try:
                with safe_open(str(file), framework="pt") as reader:
                    for name in reader.keys():  # noqa: SIM118 - safe_open is not a mapping
                        self._tensors[name] = reader.get_tensor(name)
            except (SafetensorError, OSError) as err:
                raise ModelLoadError(f"unreadable weights file {file}: {err}") from None
        self._model_dir = model_dir

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor, checked against the shape the config implies."""
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"missing tensor {name!r} in weights of {self._model_dir}")
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, config implies {shape}"
            )
        return tensor.to(device=self._device, dtype=self._dtype)
