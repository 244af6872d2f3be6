"""The 400 a malformed request gets names the form the client meant: a field that takes
several forms (a prompt as text, token ids or a list of either; ``stop``; a message's
``content``) gets pydantic errors for every form, and the string form's came first
whatever the value was."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from kvserve.worker.errors import validation_error_to_api_error
from kvserve.worker.protocol import ChatCompletionRequest, CompletionRequest


def message_for(model: type[BaseModel], body: dict[str, Any]) -> tuple[str, str]:
    with pytest.raises(ValidationError) as refused:
        model.model_validate(body)
    error = validation_error_to_api_error(refused.value.errors()).body()["error"]
    return error["param"], error["message"]


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ([-1], "prompt.0: Input should be greater than or equal to 0"),
        ([], "prompt: List should have at least 1 item after validation, not 0"),
        ([[1], []], "prompt.1: List should have at least 1 item after validation, not 0"),
        (["a", ""], "prompt.1: String should have at least 1 character"),
        (5, "prompt: Input should be a valid string"),  # no form fits: the first
    ],
)
def test_a_prompt_is_refused_in_the_form_it_was_sent_as(prompt: Any, expected: str) -> None:
    assert message_for(CompletionRequest, {"model": "m", "prompt": prompt}) == ("prompt", expected)


def test_stop_and_other_fields() -> None:
    body = {"model": "m", "prompt": "hi", "stop": [1, 2]}
    expected = ("stop", "stop.0: Input should be a valid string")
    assert message_for(CompletionRequest, body) == expected
    body = {"model": "m", "prompt": "hi", "n": 0, "temperature": -1}  # the first field's
    assert message_for(CompletionRequest, body)[0] == "temperature"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (
            [{"type": "image_url", "image_url": {"url": "x"}}],
            "messages.0.user.content.0.type: Input should be 'text'",
        ),
        (5, "messages.0.user.content: Input should be a valid string"),
    ],
)
def test_a_message_content_is_refused_in_the_form_it_was_sent_as(
    content: Any, expected: str
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    assert message_for(ChatCompletionRequest, body) == ("messages", expected)
