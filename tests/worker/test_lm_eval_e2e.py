"""``lm-eval`` against a real kvserve worker: its ``local-completions`` model (loglikelihood
through echo + logprobs on token-id prompt lists, and generate_until) and its
``local-chat-completions`` model (generate_until through the chat template), on two small
local tasks shipped in ``tests/fixtures/lm_eval_tasks`` (nothing downloaded). lm-eval runs
through its Python API, all three evaluations in one process (its command line would index
its built-in tasks first, 12 s a run); the models and requests are the command line's. No
request may fail, and every loglikelihood must equal the one lm-eval's own Hugging Face
backend computes from the same model folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess
from kvserve.router.ports import free_port
from tests.support.processes import REPO_ROOT

TASKS = REPO_ROOT / "tests/fixtures/lm_eval_tasks"
TOLERANCE = 1e-3
# What lm-eval logs when a request fails (it then retries, or gives up on the request).
FAILURE_MARKS = ("API request failed", "Exception:", "Traceback")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("lm-eval-model") / "tiny"
    subprocess.run(
        [*KVSERVE_COMMAND, "make-tiny-model", str(model)], check=True, capture_output=True
    )
    return model


@pytest.fixture(scope="module")
def worker(model_dir: Path) -> Iterator[ServerProcess]:
    port = free_port()
    args = [*KVSERVE_COMMAND, "worker", "--model", str(model_dir), "--port", str(port)]
    args += ["--device", "cpu", "--num-blocks", "512"]
    server = ServerProcess(args, f"http://127.0.0.1:{port}", name="worker").wait_healthy(90)
    yield server
    assert server.stop(timeout_s=30) == 0, server.log_tail()


def lm_eval(out: Path, runs: list[dict[str, object]]) -> None:
    """Runs lm-eval offline (the tasks' data is local) in one process
    (tests/support/lm_eval_runs.py); each run's samples by task in ``out / NAME.json``."""
    env = os.environ | {
        "HF_HOME": str(out / "hf-home"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO_ROOT),
    }
    runs = [run | {"out": str(out / f"{run['name']}.json")} for run in runs]
    command = [sys.executable, "-m", "tests.support.lm_eval_runs", str(TASKS), json.dumps(runs)]
    result = subprocess.run(
        command, cwd=TASKS, env=env, capture_output=True, text=True, timeout=400
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    for mark in FAILURE_MARKS:
        assert mark not in output, output[-4000:]


def samples(out: Path, run: str, task: str) -> list[dict]:
    return list(json.loads((out / f"{run}.json").read_text())[task])


def loglikelihoods(out: Path, run: str) -> list[float]:
    return [
        float(loglikelihood)
        for sample in samples(out, run, "kvserve_tiny_choice")
        for loglikelihood, _ in sample["filtered_resps"]
    ]


def test_local_completions_match_the_hf_backend_and_chat_runs(
    worker: ServerProcess, model_dir: Path, tmp_path: Path
) -> None:
    served = f"model=tiny,base_url={worker.url}/v1/completions,tokenizer={model_dir}"
    # add_bos_token: the HF backend's tokenizer adds BOS; the API model must send it too.
    served += ",tokenizer_backend=huggingface,num_concurrent=2,max_retries=1,add_bos_token=True"
    chat = f"model=tiny,base_url={worker.url}/v1/chat/completions,num_concurrent=2,max_retries=1"
    tasks = ["kvserve_tiny_choice", "kvserve_tiny_generate"]
    lm_eval(
        tmp_path,
        [
            {"name": "kvserve", "model": "local-completions", "model_args": served, "tasks": tasks},
            {
                "name": "hf",
                "model": "hf",
                "model_args": f"pretrained={model_dir},dtype=float32",
                "tasks": ["kvserve_tiny_choice"],
            },
            {
                "name": "chat",
                "model": "local-chat-completions",
                "model_args": chat,
                "tasks": ["kvserve_tiny_generate"],
                "apply_chat_template": True,
            },
        ],
    )
    ours, theirs = loglikelihoods(tmp_path, "kvserve"), loglikelihoods(tmp_path, "hf")
    assert len(ours) == len(theirs) == 8
    for got, want in zip(ours, theirs, strict=True):
        assert abs(got - want) < TOLERANCE, (ours, theirs)
    generated = samples(tmp_path, "kvserve", "kvserve_tiny_generate")
    assert len(generated) == 3 and all(isinstance(s["filtered_resps"][0], str) for s in generated)
    answers = samples(tmp_path, "chat", "kvserve_tiny_generate")
    assert len(answers) == 3 and all(isinstance(s["filtered_resps"][0], str) for s in answers)
