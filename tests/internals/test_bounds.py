"""The output check's read-only pass (`_loop/bounds.checked_output`, see
bench/PERFORMANCE.md) agrees with its field-by-field path, which names
problems: same items, same counts against the limits, the same object back
when nothing needs changing."""

from __future__ import annotations

from typing import Any

import pytest

from agentfsm import FunctionCallItem, InferenceOutput, ModelMessageItem
from agentfsm._loop.bounds import _cleaned_items, checked_output
from agentfsm.exceptions import OutputLimitExceeded
from agentfsm.messages import ReasoningItem, TokenUsage
from agentfsm.options import LoopOptions

OUTPUTS = [
    InferenceOutput(items=(ModelMessageItem(content="plain"),)),
    InferenceOutput(items=(ModelMessageItem(content="café ✓", refusal="non"),)),
    InferenceOutput(
        items=(
            ReasoningItem(content="think"),
            FunctionCallItem(call_id="c1", name="add", arguments='{"a":1}'),
            FunctionCallItem(call_id="c2", name="add", arguments='{"a":"é"}'),
        ),
        token_usage=TokenUsage(input_tokens=3),
        finish_reason="tool_calls",
        raw_response={"id": "r", "choices": [{"n": 1}]},
    ),
    InferenceOutput(items=()),
]


@pytest.mark.parametrize("output", OUTPUTS)
def test_the_fast_pass_agrees_with_the_checked_one(output: InferenceOutput) -> None:
    checked = checked_output(output, "m", LoopOptions())
    items, calls, chars = _cleaned_items(output.items, "m")
    assert list(checked.items) == items
    assert checked == output
    if all(
        isinstance(i, ModelMessageItem | FunctionCallItem)
        and all(v.isascii() for v in i.__dict__.values() if isinstance(v, str))
        for i in output.items
    ):
        assert checked is output  # nothing copied
    limits: dict[str, Any] = {"max_output_chars": max(chars, 1)}
    checked_output(output, "m", LoopOptions(**limits))  # at the limit: taken
    if chars:
        with pytest.raises(OutputLimitExceeded):
            checked_output(output, "m", LoopOptions(max_output_chars=chars - 1 or 1))
    if calls:
        with pytest.raises(OutputLimitExceeded):
            checked_output(output, "m", LoopOptions(max_output_calls=calls - 1 or 1))
