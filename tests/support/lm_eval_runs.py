"""lm-eval evaluations in one process, through its Python API (``simple_evaluate``) with a
task manager that knows only the tasks of one folder: lm-eval's command line first indexes
its thousands of built-in tasks, 12 s a run on an idle 2-core box, and imports torch and
transformers again for every run.

``python -m tests.support.lm_eval_runs TASKS_DIR RUNS_JSON``: ``RUNS_JSON`` is a list of
runs, each ``{"model", "model_args", "tasks", "apply_chat_template", "out"}``; a run's
logged samples, by task, are written to its ``out`` file as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks_dir, runs = sys.argv[1], json.loads(sys.argv[2])
    manager = TaskManager(include_path=tasks_dir, include_defaults=False)
    for run in runs:
        results = simple_evaluate(
            model=run["model"],
            model_args=run["model_args"],
            tasks=run["tasks"],
            device="cpu",
            task_manager=manager,
            log_samples=True,
            apply_chat_template=run.get("apply_chat_template", False),
        )
        assert results is not None
        Path(run["out"]).write_text(json.dumps(results["samples"], default=str))


if __name__ == "__main__":
    main()
