"""examples/litellm/config.yaml through LiteLLM's Router over two real replicas of the demo pair
(SmolLM2-135M-Instruct's GGUF and its head, each `dovetail-run --http --served-model-name smollm2`
behind an API key): requests are spread over both, every answer is the one a replica gives
directly, and when one replica goes down the router's retries land every request on the other."""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path

import openai
import pytest
import yaml
from gguf_support import need_fixture

from dovetail_runtime.demo_models import SMOLLM2_DRAFT, SMOLLM2_GGUF

from runtime_harness import Server

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "litellm" / "config.yaml"
KEY = "router-test-key-0123456789abcdef"
QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow.", "What do bees make?",
             "How many legs does a spider have?", "What is 12 plus 30?", "Why do we sleep?"]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    need_fixture()
    socket_dir = tmp_path_factory.mktemp("replicas")
    environment = os.environ | {"DOVETAIL_API_KEY": KEY}
    started = [Server("--target", str(SMOLLM2_GGUF), "--draft", str(SMOLLM2_DRAFT), "--http", "127.0.0.1:0",
                      "--served-model-name", "smollm2", "--bind", f"ipc://{socket_dir}/replica{index}.sock",
                      env=environment)
               for index in range(2)]
    yield started
    for replica in started:
        if replica.process.poll() is None:
            assert replica.stop() == 0


def http_url(server: Server) -> str:
    return next(endpoint for endpoint in server.endpoints if endpoint.startswith("http://"))


@pytest.fixture(scope="module")
def router(replicas):
    """The example config's Router, its os.environ/ references pointing at the two replicas."""
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # litellm reads its bundled model list, not the network
    import litellm

    config = yaml.safe_load(CONFIG.read_text())
    saved = {name: os.environ.get(name) for name in ("DOVETAIL_A", "DOVETAIL_B", "DOVETAIL_API_KEY")}
    os.environ.update(DOVETAIL_A=http_url(replicas[0]) + "/v1", DOVETAIL_B=http_url(replicas[1]) + "/v1",
                      DOVETAIL_API_KEY=KEY)
    try:
        yield litellm.Router(model_list=config["model_list"], **config["router_settings"])
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def ask(router, question: str) -> tuple[str, str]:
    """(the answer, the replica that gave it)."""
    reply = router.completion(model="smollm2", messages=[{"role": "user", "content": question}],
                              max_tokens=NEW_TOKENS, temperature=0)
    return reply.choices[0].message.content, reply._hidden_params["api_base"]


def test_the_router_spreads_requests_over_both_replicas_and_every_answer_is_a_replicas_own(replicas, router):
    direct = openai.OpenAI(base_url=http_url(replicas[0]) + "/v1", api_key=KEY, max_retries=0, timeout=300)
    expected = {question: direct.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=NEW_TOKENS,
        temperature=0).choices[0].message.content for question in QUESTIONS}
    assert all(expected.values())
    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = list(pool.map(lambda question: ask(router, question), QUESTIONS * 2))
    for (text, _), question in zip(answers, QUESTIONS * 2, strict=True):
        assert text == expected[question], question
    used = {base for _, base in answers}
    assert used == {http_url(replica) + "/v1" for replica in replicas}, used


def test_when_a_replica_goes_down_the_router_answers_from_the_other(replicas, router):
    survivor = http_url(replicas[0]) + "/v1"
    assert replicas[1].stop() == 0
    answers = [ask(router, question) for question in QUESTIONS]
    assert all(text for text, _ in answers) and {base for _, base in answers} == {survivor}
