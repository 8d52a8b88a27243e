"""The server's ``/openapi.json`` is accurate for every route: each route of the app is in the document with its
methods, its request body, its 200 answer (JSON and, for the generating routes, ``text/event-stream``) and every
error status it declares or the middleware answers in front of it; real error answers (401, 404, 400, 413, 503)
have a status the document lists for that route. In-process (Starlette's test client), a tiny random model."""

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.routing import APIRoute  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from dlm.decode.options import EngineOptions
from dlm.serve.app import ServeSettings, create_app, load_engine  # noqa: E402
from dlm.serve.scheduler import Scheduler  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny"
KEY = "sesame"
ERROR_REF = "#/components/schemas/ErrorResponse"
BODIES = {
    "/v1/completions": "CompletionRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
    "/tokenize": "TokenizeRequest",
    "/detokenize": "DetokenizeRequest",
}
STREAMED = {"/v1/completions", "/v1/chat/completions"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from dlm.testing import save_tiny

    folder = save_tiny(tmp_path_factory.mktemp("openapi") / "tiny-llama", "llama")
    return load_engine(str(folder), "ar", options=EngineOptions(threads=1, max_batch_size=4))


def make_app(engine, api_key=None):
    return create_app(Scheduler(engine), ServeSettings(model_name=MODEL, api_key=api_key))


def routes(app) -> list[APIRoute]:
    return [r for r in app.app.routes if isinstance(r, APIRoute)]  # app.app: the FastAPI app behind the middleware


def document(client, api_key=None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = client.get("/openapi.json", headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def url_of(route: APIRoute) -> str:
    return route.path_format.replace("{model_id}", MODEL)


def assert_documented(doc: dict, route_path: str, method: str, resp) -> None:
    """``resp``'s status and content type are among those the document gives for this route."""
    responses = doc["paths"][route_path][method.lower()]["responses"]
    status = str(resp.status_code)
    assert status in responses, (route_path, method, status, sorted(responses), resp.text)
    content_type = resp.headers["content-type"].split(";")[0]
    assert content_type in responses[status].get("content", {}), (route_path, method, status, content_type)


@pytest.mark.parametrize("api_key", [None, KEY])
def test_every_route_is_documented_with_its_methods_bodies_and_errors(engine, api_key):
    app = make_app(engine, api_key)
    doc = document(TestClient(app), api_key)
    app_routes = routes(app)
    assert set(doc["paths"]) == {r.path_format for r in app_routes}
    for path in doc["paths"]:
        methods = {m.lower() for r in app_routes if r.path_format == path for m in r.methods}
        assert set(doc["paths"][path]) == methods, path
    for route in app_routes:
        for method in route.methods:
            op = doc["paths"][route.path_format][method.lower()]
            responses = op["responses"]
            where = (route.path_format, method)
            assert "422" not in responses, where  # validation errors are answered with a 400
            declared = {str(s) for s in route.responses} | {"400", "413"}  # the middleware's body limit: all routes
            if api_key is not None and route.path_format != "/health":
                declared.add("401")
                assert op["security"] == [{"bearer": []}], where
            assert declared <= set(responses), (where, sorted(declared - set(responses)))
            if api_key is None or route.path_format == "/health":
                assert "401" not in responses, where
            for status, answer in responses.items():
                assert answer.get("description"), (where, status)
                if status != "200":
                    assert answer["content"] == {"application/json": {"schema": {"$ref": ERROR_REF}}}, (where, status)
            ok = responses["200"]["content"]
            model = route.responses.get(200, {}).get("model")
            if model is not None:
                assert ok["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model.__name__}"}, where
            if method == "POST":
                streams = {"text/event-stream"} if route.path_format in STREAMED else set()
                assert set(ok) == {"application/json"} | streams, where  # stream=false / true
                body = op["requestBody"]
                assert body["required"] is True, where
                assert body["content"]["application/json"]["schema"]["$ref"].endswith("/" + BODIES[route.path_format])
            else:
                assert "requestBody" not in op, where
    assert doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"] == {
        "text/plain": {"schema": {"type": "string"}}
    }
    if api_key is not None:
        assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}


def test_real_error_answers_have_documented_statuses(engine):
    # with --api-key and no key: every route but /health answers 401; the engine thread is not started here (no
    # lifespan), so /health answers 503
    app = make_app(engine, KEY)
    client = TestClient(app)
    doc = document(client, KEY)
    seen = set()
    for route in routes(app):
        for method in route.methods:
            resp = client.request(method, url_of(route), json={"model": MODEL, "prompt": "x", "messages": []})
            assert resp.status_code == (503 if route.path_format == "/health" else 401), (route.path_format, resp.text)
            assert_documented(doc, route.path_format, method, resp)
            seen.add(route.path_format)
    assert seen == set(doc["paths"])


def test_served_answers_have_documented_statuses_and_content(engine):
    app = make_app(engine)
    with TestClient(app) as client:  # runs the lifespan: the engine thread serves
        doc = document(client)
        cases = [
            ("GET", "/health", "/health", {}, 200),
            ("GET", "/metrics", "/metrics", {}, 200),
            ("GET", "/v1/models", "/v1/models", {}, 200),
            ("GET", "/v1/models/{model_id}", f"/v1/models/{MODEL}", {}, 200),
            ("GET", "/v1/models/{model_id}", "/v1/models/other", {}, 404),
            ("GET", "/health", "/health", {"headers": {"content-length": str(1 << 21)}}, 413),
        ]
        gen = {"model": MODEL, "max_tokens": 2, "temperature": 0}
        for path, extra in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": []})):
            cases += [
                ("POST", path, path, {"content": b"{not json"}, 400),
                ("POST", path, path, {"json": {**gen, **extra, "model": "other"}}, 404),
                ("POST", path, path, {"json": {**gen, **extra, "max_tokens": 10**6}}, 400),
                ("POST", path, path, {"json": {**gen, **extra, "n": "2"}}, 400),  # pydantic's 422 -> a 400
                ("POST", path, path, {"content": b"x" * (2 << 20)}, 413),
            ]
        say = [{"role": "user", "content": "Hi"}]
        cases += [
            ("POST", "/tokenize", "/tokenize", {"json": {"prompt": "Hi"}}, 200),
            ("POST", "/tokenize", "/tokenize", {"json": {"messages": say, "model": "other"}}, 404),
            ("POST", "/tokenize", "/tokenize", {"json": {"prompt": "Hi", "messages": say}}, 400),
            ("POST", "/detokenize", "/detokenize", {"json": {"tokens": [1, 2]}}, 200),
            ("POST", "/detokenize", "/detokenize", {"json": {"tokens": [-1]}}, 400),
            ("GET", "/tokenizer_info", "/tokenizer_info", {}, 200),
            ("POST", "/v1/completions", "/v1/completions", {"json": {**gen, "prompt": "Hi"}}, 200),
            ("POST", "/v1/completions", "/v1/completions", {"json": {**gen, "prompt": "Hi", "stream": True}}, 200),
            ("POST", "/v1/chat/completions", "/v1/chat/completions", {"json": {**gen, "messages": say}}, 200),
            (
                "POST",
                "/v1/chat/completions",
                "/v1/chat/completions",
                {"json": {**gen, "messages": say, "stream": True}},
                200,
            ),
        ]
        for method, route_path, url, kw, status in cases:
            resp = client.request(method, url, **kw)
            assert resp.status_code == status, (method, url, kw, resp.text)
            assert_documented(doc, route_path, method, resp)
