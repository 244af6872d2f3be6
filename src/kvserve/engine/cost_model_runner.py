"""A model runner without weights: it takes as long as a real GPU would, per the cost model.

Fleet benchmarks need many workers on one machine that behave like GPU workers in time
(step times from :mod:`kvserve.core.cost_model`, e.g. Llama-3-8B on one H100) while the
scheduler, KV cache, events and HTTP stack are the real ones. ``forward`` has the
:class:`~kvserve.engine.model_runner.ModelRunner` interface; it sleeps the modelled step
time (minus what the call itself spent) and returns logits that make every sequence
sample the same filler token, never an end-of-sequence token, so outputs are
deterministic and run to ``max_tokens``. Only config.json and the tokenizer of the model
folder are read.

The runner computes nothing, so it keeps torch to one thread: a fleet of these workers
shares a machine's cores, and torch's idle intra-op threads spin after every small op
(measured: 0.93 ms of CPU per engine step with two threads, 0.18 ms with one), which on a
few cores delays every worker's steps and every request's first token.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kvserve.core.cost_model import CostModel
from kvserve.engine.model_runner import SequenceBatchItem
from kvserve.model_folder.config import ModelConfig

_UNLIKELY = -1e4  # logit of every token but the filler: exp() underflows to 0


class CostModelRunner:
    def __init__(self, model_dir: str | Path, cost: CostModel) -> None:
        torch.set_num_threads(1)
        self.config = ModelConfig.from_dir(model_dir)
        self.device = torch.device("cpu")
        self.cost = cost
        self.filler_token_id = self._filler(self.config)

    @staticmethod
    def _filler(config: ModelConfig) -> int:
        """A middle-of-the-vocabulary id that no stop rule of the model matches."""
        avoid = set(config.eos_token_ids) | {config.bos_token_id}
        return next(t for t in range(config.vocab_size // 2, config.vocab_size) if t not in avoid)

    def intra_op_threads(self) -> tuple[int, bool, int]:
        """As :meth:`ModelRunner.intra_op_threads`: one thread, nothing governed."""
        return 1, False, 0

    def forward(self, batch: list[SequenceBatchItem]) -> torch.Tensor:
        started = time.perf_counter()
        step_s = self.cost.step_time((item.start_pos, len(item.token_ids)) for item in batch)
        rows = sum(len(item.token_ids) if item.all_logits else 1 for item in batch)
        logits = torch.full((rows, self.config.vocab_size), _UNLIKELY)
        logits[:, self.filler_token_id] = 0.0
        time.sleep(max(0.0, step_s - (time.perf_counter() - started)))
        return logits
