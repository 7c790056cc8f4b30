"""The gateway's list of accepted request fields (``pdgate.gateway.fields``)
matches the installed vLLM's request models, so ``reject_unknown_fields``
never refuses a field vLLM knows."""

from __future__ import annotations

import pytest

from pdgate.gateway.fields import VLLM_CHAT_FIELDS, VLLM_COMPLETION_FIELDS

pytestmark = pytest.mark.vllm


def test_field_lists_match_vllm() -> None:
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    except ImportError:  # older layout
        from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    assert set(CompletionRequest.model_fields) <= VLLM_COMPLETION_FIELDS
    assert set(ChatCompletionRequest.model_fields) <= VLLM_CHAT_FIELDS
