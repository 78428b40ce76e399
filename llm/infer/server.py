"""OpenAI-compatible HTTP server: POST /v1/chat/completions (JSON or SSE stream), GET /v1/models, GET /health.

Standard library only (`http.server`, one thread per connection). Generation is serialised by a lock,
so concurrent requests queue instead of interleaving on the model. A malformed request gets a 4xx
with an OpenAI-style JSON error body; an unexpected failure gets a 500, and the server keeps serving.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from llm.infer.generate import TextGenerator
from llm.infer.sampling import SamplingParams
from llm.tokenizer import Tokenizer

MAX_BODY_BYTES = 1 << 20
ROLES = ("system", "user", "assistant")


class RequestError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def parse_chat_request(body: Any, default_max_tokens: int) -> tuple[list[dict[str, str]], SamplingParams, bool]:
    """(messages, sampling parameters, stream) from a chat-completions body, or RequestError."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise RequestError(f"messages[{i}] needs a role in {ROLES} and a string content", f"messages[{i}]")
    if body.get("n", 1) != 1:
        raise RequestError("only n=1 is supported", "n")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError("'stop' must be a string or a list of strings", "stop")
    numbers = {}
    for key, kind, default in (("max_tokens", int, default_max_tokens), ("temperature", (int, float), 1.0),
                               ("top_p", (int, float), 1.0), ("seed", int, None)):
        value = body.get("max_completion_tokens", body.get(key)) if key == "max_tokens" else body.get(key)
        value = default if value is None else value
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise RequestError(f"'{key}' must be a number", key)
        numbers[key] = value
    try:
        params = SamplingParams(max_new_tokens=numbers["max_tokens"], temperature=float(numbers["temperature"]),
                                top_p=float(numbers["top_p"]), stop=stop, seed=numbers["seed"])
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be true or false", "stream")
    return messages, params, stream


class ChatService:
    """The model behind the server: one generation at a time."""

    def __init__(self, generator: TextGenerator, model_name: str, default_max_tokens: int = 256) -> None:
        self.generator, self.model_name, self.default_max_tokens = generator, model_name, default_max_tokens
        self.lock = threading.Lock()
        self.created = int(time.time())

    def prompt(self, messages: list[dict[str, str]]) -> str:
        return Tokenizer.render_chat(messages, add_generation_prompt=True)

    def finish_reason(self, text: str, params: SamplingParams) -> str:
        return "length" if len(self.generator.tokenizer.encode(text)) >= params.max_new_tokens else "stop"


def _make_handler(service: ChatService):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args) -> None:  # keep the console for the operator's own output
            pass

        def _json(self, status: int, payload: dict) -> None:
            data = json.dumps(payload, ensure_ascii=False).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str, param: str | None = None) -> None:
            kind = "invalid_request_error" if status < 500 else "server_error"
            self._json(status, {"error": {"message": message, "type": kind, "param": param, "code": None}})

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": service.model_name, "object": "model",
                                                             "created": service.created, "owned_by": "zerollm"}]})
            else:
                self._error(404, f"no route GET {self.path}")

        def do_POST(self) -> None:
            if self.path != "/v1/chat/completions":
                self._error(404, f"no route POST {self.path}")
                return
            try:
                length = int(self.headers.get("Content-Length", 0))
                if length > MAX_BODY_BYTES:
                    raise RequestError("request body too large", status=413)
                try:
                    body = json.loads(self.rfile.read(length) or b"null")
                except (json.JSONDecodeError, UnicodeDecodeError):
                    raise RequestError("the request body is not valid JSON") from None
                messages, params, stream = parse_chat_request(body, service.default_max_tokens)
                prompt = service.prompt(messages)
                with service.lock:
                    if stream:
                        self._stream(prompt, params)
                    else:
                        text = "".join(service.generator.stream(prompt, params))
                        self._json(200, self._completion(prompt, text, params))
            except RequestError as exc:
                self._error(exc.status, str(exc), exc.param)
            except ValueError as exc:  # e.g. prompt + max_tokens longer than the model's context
                self._error(400, str(exc))
            except Exception as exc:  # noqa: BLE001 - answer, log and keep serving
                self._error(500, f"internal error: {type(exc).__name__}: {exc}")

        def _completion(self, prompt: str, text: str, params: SamplingParams) -> dict:
            tok = service.generator.tokenizer
            prompt_tokens, completion_tokens = len(tok.encode(prompt)), len(tok.encode(text))
            return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                    "model": service.model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": service.finish_reason(text, params)}],
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                              "total_tokens": prompt_tokens + completion_tokens}}

        def _stream(self, prompt: str, params: SamplingParams) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                    "created": int(time.time()), "model": service.model_name}

            def send(delta: dict, finish: str | None = None) -> None:
                chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                self.wfile.write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())
                self.wfile.flush()

            send({"role": "assistant", "content": ""})
            pieces = []
            for piece in service.generator.stream(prompt, params):
                pieces.append(piece)
                send({"content": piece})
            send({}, service.finish_reason("".join(pieces), params))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the default backlog (5) refuses bursts of concurrent clients


def make_server(service: ChatService, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    return _Server((host, port), _make_handler(service))
