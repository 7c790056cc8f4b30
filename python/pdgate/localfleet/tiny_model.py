"""Build a tiny, context-sensitive Llama model and tokenizer on local disk.

No model can be downloaded on the machines pdgate is developed and tested on,
so the local fleet (demo, end-to-end tests) serves a model made here: a
byte-level BPE tokenizer trained on a few sentences and a 2-layer
``LlamaForCausalLM`` with random weights (see ../shared/FIELD_NOTES.md).

With the default init a random Llama's greedy output collapses to one repeated
token, which would hide corrupted KV cache. The weights are therefore scaled up
(``init_scale``) so that greedy continuations depend on the whole prompt; the
end-to-end tests prove that property on the served model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: Bumped whenever the recipe below changes, so cached models are rebuilt.
RECIPE_VERSION = 3

_CORPUS = [
    "Prefill is compute bound: the whole prompt is processed at once.",
    "Decode is memory bound and emits one token per step.",
    "The KV cache moves from the prefill instance to the decode instance.",
    "A gateway routes each request to an instance by a policy.",
    "Goodput counts the requests that meet their TTFT and TPOT SLOs.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Long prompts wait while short ones go first, with aging so none starves.",
    "Blocks of sixteen tokens are transferred without staging copies.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "Operators scrape metrics with Prometheus and watch dashboards.",
]


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    vocab_size: int = 512,
    hidden_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 4096,
    init_scale: float = 8.0,
    seed: int = 0,
) -> Path:
    """Create (or reuse) a tiny Llama model directory servable by vLLM.

    Args:
        out_dir: target directory; reused as is when it already holds a model
            built by the same recipe version and arguments.
        vocab_size: BPE vocabulary size (tokens).
        hidden_size: model width; ``hidden_size / num_heads`` is the head dim
            and must be 64 or more for vLLM's CPU attention (head_dim 16 fails).
        num_layers: decoder layers.
        num_heads: attention heads; ``num_kv_heads`` KV heads (GQA).
        max_position_embeddings: the model's context length (tokens).
        init_scale: multiplier on the random init so greedy decoding depends
            on the whole prompt instead of collapsing to one token.
        seed: RNG seed; the same seed gives byte-identical weights.

    Returns:
        The model directory (config.json, model.safetensors, tokenizer files).

    Raises:
        ImportError: if ``torch``, ``transformers`` or ``tokenizers`` is missing
            (they come with the ``pdgate[vllm]`` extra).
    """
    out = Path(out_dir)
    spec = {
        "recipe": RECIPE_VERSION,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "init_scale": init_scale,
        "seed": seed,
    }
    stamp = out / "pdgate_tiny_model.json"
    if stamp.exists() and json.loads(stamp.read_text()) == spec:
        return out
    if hidden_size // num_heads < 64:
        raise ValueError("head_dim = hidden_size / num_heads must be >= 64 for vLLM's CPU attention")

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    # A minimal chat template so /v1/chat/completions works on the tiny model.
    hf_tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    hf_tok.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(  # type: ignore[call-arg]  # torch_dtype: read by transformers, absent from its stubs
        vocab_size=len(hf_tok),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                continue
            param.mul_(init_scale)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(spec))
    return out
