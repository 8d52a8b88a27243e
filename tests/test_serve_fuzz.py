"""Schema fuzzing of ``dlm serve``: schemathesis generates requests for every route of the server's own
``/openapi.json`` (valid and invalid bodies, odd types, huge numbers) against a server on a loopback port with a
tiny random model. Pass: no 5xx, every non-2xx answer in the OpenAI error shape, every answer as the document
describes it (status code, content type, body schema), and afterwards the server still answers ``/health`` and an
ordinary completion.

Bounded: a few dozen requests per route by default; ``HYPOTHESIS_PROFILE=ci`` (tests/conftest.py) runs hundreds.
The same run from the command line (against any running server) is in docs/reliability.md.
"""

from __future__ import annotations

import json
import os

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
import httpx  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

from dlm.decode.configs import ISDConfig  # noqa: E402
from dlm.decode.options import EngineOptions  # noqa: E402
from dlm.serve.app import ServerThread, ServeSettings, create_app, load_engine  # noqa: E402
from dlm.serve.scheduler import Scheduler  # noqa: E402

pytestmark = [
    pytest.mark.integration,
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:--stride:UserWarning"),
]

MODEL = "tiny"
PER_ROUTE = 300 if os.environ.get("HYPOTHESIS_PROFILE") == "ci" else 40


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    from dlm.testing import save_tiny

    folder = save_tiny(tmp_path_factory.mktemp("fuzz") / "tiny-llama", "llama")
    engine = load_engine(str(folder), ISDConfig(stride=2), options=EngineOptions(threads=1, max_batch_size=16))
    app = create_app(Scheduler(engine), ServeSettings(model_name=MODEL, max_tokens_limit=4, max_body_bytes=64 * 1024))
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    doc = httpx.get(fuzz_server.url + "/openapi.json", timeout=30).json()
    return schemathesis.openapi.from_dict(doc)


def openai_error_shape(ctx, response, case):
    """Every answer that is not a 2xx is ``{"error": {"message", "type", "param", "code"}}`` with a message."""
    if response.status_code < 400:
        return None
    body = json.loads(response.content)
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return None


CHECKS = [
    schemathesis.checks.not_a_server_error,
    schemathesis.checks.status_code_conformance,
    schemathesis.checks.content_type_conformance,
    schemathesis.checks.response_schema_conformance,
]


def _call_and_check(case, url):
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = MODEL  # the served model, so the bodies get past the 404 and reach the engine
    if isinstance(case.body, dict) and case.body.get("stream") is True:
        case.body["stream"] = False  # an event stream is checked in tests/test_serve.py; here the JSON answer
    response = case.call(base_url=url, timeout=60)
    case.validate_response(response, checks=CHECKS + [openai_error_shape])


# Hypothesis drives schemathesis' per-operation strategies directly: schemathesis' pytest plugin (its lazy
# ``from_fixture`` path) writes pytest's private ``Node._nodeid``, which pytest 9.2 no longer has; this form uses
# only schemathesis' public API and Hypothesis, so a pytest release cannot break it.
@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=lambda m: m.value)
def test_every_route_answers_every_generated_request_as_documented(api_schema, fuzz_server, mode):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 9, [op.label for op in operations]
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=PER_ROUTE, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def fuzz(case):
            _call_and_check(case, fuzz_server.url)

        try:
            fuzz()
        except Unsatisfiable:
            # an operation without parameters or body (GET /health) has no invalid request to generate
            assert mode is schemathesis.GenerationMode.NEGATIVE, operation.label
        except Exception as exc:  # name the operation whose generated request failed
            raise AssertionError(f"{operation.label} ({mode.value}): {exc}") from exc


def test_the_server_still_serves_after_the_fuzzing(fuzz_server):
    # runs after the fuzz test in file order (same module-scoped server)
    h = httpx.get(fuzz_server.url + "/health", timeout=30)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    r = httpx.post(
        fuzz_server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "The cat", "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_the_document_covers_every_route_and_no_422(fuzz_server):
    doc = httpx.get(fuzz_server.url + "/openapi.json", timeout=30).json()
    assert set(doc["paths"]) == {
        "/health",
        "/metrics",
        "/v1/models",
        "/v1/models/{model_id}",
        "/v1/completions",
        "/v1/chat/completions",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
    }
    for path, item in doc["paths"].items():
        for method, op in item.items():
            assert "422" not in op["responses"], (path, method)
            if method == "post":
                assert {"200", "400", "404", "413"} <= set(op["responses"]), (path, op["responses"].keys())
