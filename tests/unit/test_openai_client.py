"""The official ``openai`` Python client against the gateway (fake instances)."""

from __future__ import annotations

from typing import Iterator

import openai
import pytest

from pdgate.config import GatewayConfig
from pdgate.gateway import create_app
from tests.fakes import FakeInstance, serve_app_in_thread


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    p, d = FakeInstance("p0").start(), FakeInstance("d0").start()
    app = create_app(GatewayConfig(prefill=[p.url], decode=[d.url]))
    server, thread, url = serve_app_in_thread(app)
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    server.should_exit = True
    thread.join(5)
    p.stop()
    d.stop()


def test_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(model="m", prompt="a b", max_tokens=3)
    assert r.choices[0].text == "t0 t1 t2"
    assert r.usage is not None and r.usage.completion_tokens == 3


def test_completions_stream(client: openai.OpenAI) -> None:
    stream = client.completions.create(model="m", prompt="a b", max_tokens=4, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "t0 t1 t2 t3 "
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_chat(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2)
    assert r.choices[0].message.content == "t0 t1"


def test_chat_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=3, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "t0 t1 t2 "


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["fake-model", "m"]


def test_bad_request_raises_openai_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="x", max_tokens=-3)
    assert e.value.status_code == 400
    assert "max_tokens" in str(e.value)
