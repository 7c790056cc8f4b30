"""Trace loaders, windowing/scaling/caps, Mooncake slot spreading, prompt synthesis."""

from __future__ import annotations

import itertools
import json
import os

import pytest

from pdgate.bench.traces import (
    LoadedTrace,
    ReplayPlan,
    TraceRequest,
    detect_format,
    load_azure_csv,
    load_mooncake_jsonl,
    make_plan,
)
from pdgate.bench.prompts import (
    PromptSynthesizer,
)

TRACES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "traces")
AZURE = os.path.join(TRACES, "azure2023_code.csv")
MOONCAKE = os.path.join(TRACES, "mooncake_fast25_conversation.jsonl")
need_traces = pytest.mark.skipif(not os.path.exists(AZURE), reason="shared/traces not present")

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefill and decode run on separate servers in a disaggregated fleet.",
    "A gateway routes each request to a prefill instance and then to a decode instance.",
    "Tokens stream back to the client as server sent events, one chunk at a time.",
    "Time to first token and time per output token are the usual latency objectives.",
    "The model reads a long prompt, fills its cache, and writes a short answer.",
]


@pytest.fixture(scope="module")
def tiny_tok():
    """ByteLevel BPE (vocab <= 512) trained here, wrapped as an HF fast tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(SENTENCES * 10, vocab_size=512, min_frequency=1, show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)


# ---------------------------------------------------------------- loaders


@need_traces
def test_azure_first_rows():
    tr = load_azure_csv(AZURE, limit_rows=5)
    assert tr.format == "azure" and tr.name == "azure2023_code.csv"
    # First rows of the file: 18:17:03.9799600, 04.0319600, 04.0781490, 04.1206440, 04.4249540
    expected = [0.0, 0.052, 0.098189, 0.140684, 0.444994]
    assert [r.arrival_s for r in tr.requests] == pytest.approx(expected, abs=1e-6)
    assert [r.prompt_tokens for r in tr.requests] == [4808, 3180, 110, 7433, 34]
    assert [r.output_tokens for r in tr.requests] == [10, 8, 27, 14, 12]
    assert [r.index for r in tr.requests] == [0, 1, 2, 3, 4]
    assert all(r.hash_ids is None for r in tr.requests)


def _raw_mooncake(n):
    with open(MOONCAKE) as f:
        return [json.loads(line) for line in itertools.islice(f, n)]


@need_traces
def test_mooncake_slot_spreading():
    raw = _raw_mooncake(40)
    tr = load_mooncake_jsonl(MOONCAKE, limit_rows=40, seed=0)
    assert tr.format == "mooncake" and len(tr.requests) == 40
    assert any("3 s slots" in n for n in tr.notes)
    by_index = {r.index: r for r in tr.requests}
    for i, row in enumerate(raw):
        r = by_index[i]
        slot = row["timestamp"] / 1000.0
        assert slot <= r.arrival_s < slot + 3.0
        assert r.prompt_tokens == row["input_length"]
        assert r.output_tokens == row["output_length"]
        assert r.hash_ids == row["hash_ids"]
    arrivals = [r.arrival_s for r in tr.requests]
    assert arrivals == sorted(arrivals)
    # The 10 requests of slot 0 are no longer a burst at t=0.
    first_slot = sorted(by_index[i].arrival_s for i in range(10))
    assert len(set(first_slot)) == 10 and first_slot[-1] - first_slot[0] > 1.0
    # Deterministic per seed, independent of how many rows were read.
    again = load_mooncake_jsonl(MOONCAKE, limit_rows=20, seed=0)
    assert {r.index: r.arrival_s for r in again.requests} == {i: by_index[i].arrival_s for i in range(20)}
    other = load_mooncake_jsonl(MOONCAKE, limit_rows=40, seed=1)
    assert [r.arrival_s for r in other.requests] != arrivals
    bursty = load_mooncake_jsonl(MOONCAKE, limit_rows=40, spread_slots=False)
    assert sorted(r.arrival_s for r in bursty.requests)[:10] == [0.0] * 10


def test_detect_format():
    assert detect_format("x/azure.CSV") == "azure"
    assert detect_format("a.jsonl") == "mooncake"
    with pytest.raises(ValueError):
        detect_format("trace.parquet")


# ---------------------------------------------------------------- windowing


def _toy_trace():
    reqs = [
        TraceRequest(arrival_s=t, prompt_tokens=p, output_tokens=o, index=i)
        for i, (t, p, o) in enumerate([(0.0, 100, 5), (1.0, 3000, 50), (2.5, 800, 400), (4.0, 10, 0), (7.0, 20, 2)])
    ]
    return LoadedTrace("toy.csv", "azure", reqs)


def test_window_and_time_scale():
    plan = make_plan(_toy_trace(), start_s=1.0, duration_s=3.5, time_scale=2.0)
    # Window [1.0, 4.5) holds arrivals 1.0, 2.5, 4.0; gaps 1.5 and 1.5 become 3.0 and 3.0.
    assert [r.index for r in plan.requests] == [1, 2, 3]
    assert [r.arrival_s for r in plan.requests] == pytest.approx([0.0, 3.0, 6.0])
    assert plan.window_replay_s == pytest.approx(7.0)
    assert plan.offered_rate() == pytest.approx(3 / 7.0)
    d = plan.describe()
    assert "toy.csv" in d and "x2" in d and "3 of 5 requests" in d and "[1, 4.5)" in d
    # the window outlasts the last arrival: the line says when arrivals end
    assert "over a 7 s window (last arrival at 6 s)" in d
    # Output length 0 in the trace is raised to 1 (max_tokens must be >= 1).
    assert plan.requests[2].output_tokens == 1


def test_progress_line_names_a_gap_in_the_trace():
    from pdgate.bench.replay import progress_line

    plan = make_plan(_toy_trace(), start_s=1.0, duration_s=3.5, time_scale=10.0)  # arrivals 0, 15, 30 s
    assert progress_line(plan, 0.5, 1, 0, 0) == "[    0.5s] sent 1/3 done 0 failed 0 (gap in the trace: next request in 14 s)"
    assert "gap" not in progress_line(plan, 14.0, 1, 1, 0)   # the next one is 1 s away
    assert "gap" not in progress_line(plan, 31.0, 3, 2, 1)   # all sent


def test_max_requests_and_faster_scale():
    plan = make_plan(_toy_trace(), max_requests=2, time_scale=0.5)
    assert [r.arrival_s for r in plan.requests] == pytest.approx([0.0, 0.5])
    assert plan.truncated and plan.window_replay_s == pytest.approx(0.5)
    assert "first 2 requests" in plan.describe() and "(faster)" in plan.describe()
    with pytest.raises(ValueError):
        make_plan(_toy_trace(), time_scale=0)


def test_caps_are_counted_and_truncate_hash_ids():
    reqs = [
        TraceRequest(0.0, 1300, 700, hash_ids=[0, 1, 2], index=0),
        TraceRequest(1.0, 500, 20, hash_ids=[0], index=1),
        TraceRequest(2.0, 1025, 90, hash_ids=[0, 5, 6], index=2),
    ]
    plan = make_plan(LoadedTrace("m.jsonl", "mooncake", reqs), max_prompt_tokens=1024, max_output_tokens=64)
    assert [r.prompt_tokens for r in plan.requests] == [1024, 500, 1024]
    assert [r.output_tokens for r in plan.requests] == [64, 20, 64]
    assert (plan.n_prompt_capped, plan.n_output_capped) == (2, 2)
    assert [r.hash_ids for r in plan.requests] == [[0, 1], [0], [0, 5]]
    assert plan.requests[0].orig_prompt_tokens == 1300 and plan.requests[0].orig_output_tokens == 700
    d = plan.describe()
    assert "prompt cap 1024 tok (2/3 capped)" in d and "output cap 64 tok (2/3 capped)" in d
    sd = plan.scaling_dict()
    assert sd["prompt_capped"] == 2 and sd["max_output_tokens"] == 64 and sd["requests"] == 3


@need_traces
def test_real_trace_window():
    tr = load_azure_csv(AZURE, limit_rows=200)
    plan = make_plan(tr, start_s=0.0, duration_s=1.0, time_scale=3.0)
    assert plan.requests and all(0 <= r.arrival_s < 3.0 for r in plan.requests)
    assert isinstance(plan, ReplayPlan) and plan.trace_rows == 200


# ---------------------------------------------------------------- prompts


@pytest.mark.parametrize("n", [1, 2, 7, 100, 511, 512, 513, 1300])
def test_ids_prompts_exact_length(tiny_tok, n):
    synth = PromptSynthesizer(tiny_tok, seed=3)
    p = synth.synthesize(TraceRequest(0.0, n, 4, index=n))
    assert isinstance(p.prompt, list) and len(p.prompt) == n and p.token_error == 0
    specials = set(tiny_tok.all_special_ids)
    assert not specials.intersection(p.prompt)
    # Deterministic: a fresh synthesizer with the same seed gives the same ids.
    assert PromptSynthesizer(tiny_tok, seed=3).synthesize(TraceRequest(5.0, n, 9, index=n)).prompt == p.prompt


def test_text_prompts_length(tiny_tok):
    synth = PromptSynthesizer(tiny_tok, seed=0, prompt_mode="text")
    for n in (1, 5, 64, 600, 1500):
        p = synth.synthesize(TraceRequest(0.0, n, 4, index=n))
        assert isinstance(p.prompt, str)
        actual = len(tiny_tok.encode(p.prompt, add_special_tokens=False))
        assert actual == p.n_tokens  # the reported count is the real one
        assert abs(p.token_error) <= 1


def test_prompts_differ_between_requests_and_seeds(tiny_tok):
    a = PromptSynthesizer(tiny_tok, seed=0).token_ids(TraceRequest(0, 300, 1, index=1))
    b = PromptSynthesizer(tiny_tok, seed=0).token_ids(TraceRequest(0, 300, 1, index=2))
    c = PromptSynthesizer(tiny_tok, seed=1).token_ids(TraceRequest(0, 300, 1, index=1))
    assert a != b and a != c and a[:16] != b[:16]


def test_mooncake_shared_blocks(tiny_tok):
    synth = PromptSynthesizer(tiny_tok, seed=0)
    r1 = TraceRequest(0.0, 1400, 4, hash_ids=[0, 1, 2], index=0)
    r2 = TraceRequest(1.0, 1200, 4, hash_ids=[0, 1, 9], index=1)
    r3 = TraceRequest(2.0, 700, 4, hash_ids=[0, 7], index=2)
    r4 = TraceRequest(3.0, 600, 4, hash_ids=[5, 1], index=3)
    p1, p2, p3, p4 = (synth.token_ids(r) for r in (r1, r2, r3, r4))
    assert [len(p) for p in (p1, p2, p3, p4)] == [1400, 1200, 700, 600]
    assert p1[:1024] == p2[:1024]  # two shared 512-token blocks
    assert p1[1024:1040] != p2[1024:1040]  # third block differs
    assert p1[:512] == p3[:512] and p1[512:528] != p3[512:528]
    assert p4[:16] != p1[:16]  # different first block: no shared prefix
    assert p4[512:600] == p1[512:600]  # same block content, but not a prefix
    # A second synthesizer reproduces the same blocks (no dependence on order).
    assert PromptSynthesizer(tiny_tok, seed=0).token_ids(r2) == p2


def test_no_tokenizer_vocab_ids():
    synth = PromptSynthesizer(None, vocab_size=1000, seed=0)
    ids = synth.token_ids(TraceRequest(0.0, 700, 1, index=0))
    assert len(ids) == 700 and all(100 <= i < 1000 for i in ids)
    with pytest.raises(ValueError):
        PromptSynthesizer(None, prompt_mode="text", vocab_size=1000)
    with pytest.raises(ValueError):
        PromptSynthesizer(None)


class _CharTok:
    """Minimal non-HF tokenizer: one token per character (encode/decode only)."""

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_plain_encode_decode_tokenizer():
    for mode in ("ids", "text"):
        p = PromptSynthesizer(_CharTok(), prompt_mode=mode).synthesize(TraceRequest(0.0, 77, 1, index=0))
        assert p.n_tokens == 77 and p.token_error == 0
