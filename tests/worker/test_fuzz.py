"""Schema-driven fuzzing of the worker's OpenAPI: no generated input gives a 5xx.

Both schemathesis modes run for every operation that takes input: positive (valid by the
schema; with the served model's name, so that it reaches the engine) and negative
(violating the schema: wrong types, out-of-range values, missing fields), which must
come back as 4xx.
"""

from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from kvserve.router.local_fleet import ServerProcess
from tests.worker.worker_process import AUTH, served_model

# Generated lengths are clamped so that each case costs milliseconds, not a full context
# of decoding; the parameters' validation is exercised all the same.
_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens")
_LENGTH_FIELDS = (*_LIMIT_FIELDS, "min_tokens")
_MAX_FUZZ_TOKENS = 4
# Choices multiply a case's cost (a chat without max_tokens decodes to the end of the
# context, n times over); min() keeps best_of >= n where it held.
_CHOICE_FIELDS = ("n", "best_of")
_MAX_FUZZ_CHOICES = 3
_MAX_FUZZ_WAIT_S = 0.1
_EXAMPLES_PER_OPERATION = 15
_GENERATION_ROUTES = ("POST /v1/completions", "POST /v1/chat/completions")


def adapt_case(case: schemathesis.Case, model: str, mode: GenerationMode) -> None:
    if isinstance(case.body, dict):
        for name in _LENGTH_FIELDS:
            value = case.body.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                case.body[name] = min(value, _MAX_FUZZ_TOKENS)
        for name in _CHOICE_FIELDS:
            value = case.body.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                case.body[name] = min(value, _MAX_FUZZ_CHOICES)
        if mode is GenerationMode.POSITIVE and "model" in case.body:
            case.body["model"] = model
        if mode is GenerationMode.POSITIVE and not any(f in case.body for f in _LIMIT_FIELDS):
            # no length at all decodes to the end of the context: over 30 s on a loaded box
            case.body["max_tokens"] = _MAX_FUZZ_TOKENS
    if isinstance(case.query, dict):
        wait = case.query.get("timeout")
        if isinstance(wait, int | float) and not isinstance(wait, bool):
            case.query["timeout"] = min(wait, _MAX_FUZZ_WAIT_S)


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda mode: mode.value)
def test_no_generated_request_gets_a_server_error(
    worker: ServerProcess, mode: GenerationMode
) -> None:
    model = served_model(worker)
    schema = schemathesis.openapi.from_url(f"{worker.url}/openapi.json", headers=AUTH)
    operations = [result.ok() for result in schema.get_all_operations()]
    if mode is GenerationMode.NEGATIVE:  # an operation without input has no invalid form
        operations = [op for op in operations if op.query or op.body]
    statuses: Counter[tuple[str, int]] = Counter()
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=_EXAMPLES_PER_OPERATION,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def call(case: schemathesis.Case) -> None:
            adapt_case(case, model, mode)
            response = case.call(headers=AUTH, timeout=30)
            statuses[case.operation.label, response.status_code] += 1
            case.validate_response(response, checks=[not_a_server_error])

        call()

    for route in _GENERATION_ROUTES:
        served = statuses[route, 200]
        refused = sum(
            n for (label, status), n in statuses.items() if label == route and status >= 400
        )
        if mode is GenerationMode.POSITIVE:
            assert served > 0, statuses
        else:
            assert refused > 0 and served == 0, statuses
