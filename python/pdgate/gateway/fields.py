"""Top-level request fields the gateway accepts (``limits.reject_unknown_fields``).

vLLM's OpenAI server ignores unknown fields with a log line; the gateway
refuses them (400) instead so a typo never silently changes a request. The
lists are the fields of vLLM 0.32's ``CompletionRequest`` and
``ChatCompletionRequest`` (``tests/e2e`` checks them against the installed
vLLM), plus OpenAI API fields clients send that vLLM ignores, plus the
gateway's own (``slo_class``).
"""

from __future__ import annotations

_COMMON = frozenset({
    "add_special_tokens", "allowed_token_ids", "bad_words", "cache_salt", "ec_transfer_params", "echo",
    "frequency_penalty", "ignore_eos", "include_stop_str_in_output", "kv_transfer_params", "length_penalty",
    "logit_bias", "logprob_token_ids", "logprobs", "max_tokens", "min_p", "min_tokens", "mm_payload",
    "model", "n", "presence_penalty", "priority", "prompt_logprobs", "repetition_detection",
    "repetition_penalty", "request_id", "response_format", "return_mm_kwargs", "return_token_ids",
    "return_token_offsets", "return_tokens_as_token_ids", "routed_experts_prompt_start", "seed",
    "session_id", "skip_special_tokens", "spaces_between_special_tokens", "stop", "stop_token_ids",
    "stream", "stream_interval", "stream_options", "structured_outputs", "temperature",
    "thinking_token_budget", "top_k", "top_p", "truncate_prompt_tokens", "truncation_side",
    "use_beam_search", "user", "vllm_xargs", "watermarking",
})

#: vLLM 0.32 ``CompletionRequest`` fields.
VLLM_COMPLETION_FIELDS = _COMMON | {"prompt", "prompt_embeds", "suffix"}

#: vLLM 0.32 ``ChatCompletionRequest`` fields.
VLLM_CHAT_FIELDS = _COMMON | {
    "add_generation_prompt", "chat_template", "chat_template_kwargs", "continue_final_message",
    "documents", "include_reasoning", "max_completion_tokens", "media_io_kwargs", "messages",
    "mm_processor_kwargs", "parallel_tool_calls", "reasoning_effort", "return_prompt_text",
    "tool_choice", "tools", "top_logprobs",
}

#: OpenAI API fields vLLM accepts and ignores (sent by OpenAI SDK users).
OPENAI_EXTRA_FIELDS = frozenset({
    "best_of", "metadata", "store", "service_tier", "modalities", "prediction", "functions",
    "function_call", "audio", "verbosity", "web_search_options", "max_completion_tokens",
})

#: Fields only the gateway reads (removed or interpreted before forwarding).
GATEWAY_FIELDS = frozenset({"slo_class"})

ALLOWED_FIELDS = {
    "completions": VLLM_COMPLETION_FIELDS | OPENAI_EXTRA_FIELDS | GATEWAY_FIELDS,
    "chat/completions": VLLM_CHAT_FIELDS | OPENAI_EXTRA_FIELDS | GATEWAY_FIELDS,
}
