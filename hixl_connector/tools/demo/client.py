"""Minimal HTTP client for a vLLM OpenAI server or the router (standard library only).

Token ids come from ``"return_token_ids": true``. vLLM 0.32 reports them as follows:
- completions: ``choices[0].token_ids`` and ``choices[0].prompt_token_ids``;
- chat: ``choices[0].token_ids`` and a top-level ``prompt_token_ids``;
- streaming (both): each chunk's ``choices[0].token_ids`` holds that chunk's new ids; the first
  chunk carries the prompt ids (in the choice for completions, top-level for chat).
``kv_transfer_params`` is top-level in a response and, when set, in the final stream chunk.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_TIMEOUT_S = 120.0
# The kv_transfer_params a P/D router sends with the prefill leg (vllm-router, NixlConnector
# protocol): P computes the prompt and answers with what D needs to pull it.
PREFILL_LEG_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class RequestFailed(RuntimeError):
    """The server answered with an HTTP error or an unreadable body."""


def push_identity(answer: Mapping[str, Any] | None) -> dict[str, Any]:
    """The kv_transfer_params vllm-router sends D once P answered with ``answer``, its push
    identity: P named by address only, the legs matched by the shared X-Request-Id."""
    if not answer or answer.get("transfer_mode") != "push":
        raise RequestFailed(f"P did not answer with a push identity: {answer!r}")
    keys = ("remote_engine_id", "remote_host", "remote_port", "tp_size")
    return {"do_remote_prefill": True, "do_remote_decode": False, **{k: answer[k] for k in keys}}


@dataclass
class Generation:
    """The outcome of one completion or chat request."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int] | None
    finish_reason: str | None
    kv_transfer_params: dict[str, Any] | None
    latency_s: float
    raw: list[dict[str, Any]] = field(default_factory=list)


def _request(
    url: str, body: Mapping[str, Any] | None, headers: Mapping[str, str] | None, timeout_s: float
) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    req.add_header("Content-Type", "application/json")
    for key, value in (headers or {}).items():
        req.add_header(key, value)
    try:
        return urllib.request.urlopen(req, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:2000]
        raise RequestFailed(f"{url}: HTTP {exc.code}: {detail}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise RequestFailed(f"{url}: {exc}") from exc


def post_json(
    url: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict[str, Any]:
    with _request(url, body, headers, timeout_s) as resp:
        raw = resp.read()
    try:
        parsed = json.loads(raw)
    except ValueError as exc:
        raise RequestFailed(f"{url}: not JSON: {raw[:500]!r}") from exc
    if not isinstance(parsed, dict):
        raise RequestFailed(f"{url}: expected a JSON object, got {type(parsed).__name__}")
    return parsed


def post_sse(
    url: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Iterator[dict[str, Any]]:
    """Yield the JSON events of a server-sent-event stream until ``[DONE]``."""
    with _request(url, body, headers, timeout_s) as resp:
        for line_bytes in resp:
            line = line_bytes.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[len("data:") :].strip()
            if payload == "[DONE]":
                return
            event = json.loads(payload)
            if isinstance(event, dict) and "error" in event and "choices" not in event:
                raise RequestFailed(f"{url}: error event: {payload[:2000]}")
            yield event
    raise RequestFailed(f"{url}: stream ended without [DONE]")


def _from_response(resp: dict[str, Any], chat: bool, latency_s: float) -> Generation:
    choice = resp["choices"][0]
    text = choice["message"].get("content") or "" if chat else choice.get("text", "")
    prompt_ids = resp.get("prompt_token_ids") if chat else choice.get("prompt_token_ids")
    return Generation(
        text=text,
        token_ids=list(choice.get("token_ids") or []),
        prompt_token_ids=prompt_ids,
        finish_reason=choice.get("finish_reason"),
        kv_transfer_params=resp.get("kv_transfer_params"),
        latency_s=latency_s,
        raw=[resp],
    )


def _from_stream(events: Sequence[dict[str, Any]], chat: bool, latency_s: float) -> Generation:
    pieces: list[str] = []
    token_ids: list[int] = []
    prompt_ids: list[int] | None = None
    finish: str | None = None
    kv_params: dict[str, Any] | None = None
    for event in events:
        if event.get("prompt_token_ids") is not None:
            prompt_ids = event["prompt_token_ids"]
        if event.get("kv_transfer_params") is not None:
            kv_params = event["kv_transfer_params"]
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {} if chat else choice
            pieces.append(delta.get("content" if chat else "text") or "")
            token_ids.extend(choice.get("token_ids") or [])
            if not chat and choice.get("prompt_token_ids") is not None:
                prompt_ids = choice["prompt_token_ids"]
            finish = choice.get("finish_reason") or finish
    return Generation(
        "".join(pieces), token_ids, prompt_ids, finish, kv_params, latency_s, [*events]
    )


def _generate(
    base_url: str,
    path: str,
    body: dict[str, Any],
    chat: bool,
    headers: Mapping[str, str] | None,
    timeout_s: float,
) -> Generation:
    start = time.monotonic()
    url = base_url.rstrip("/") + path
    if body.get("stream"):
        events = list(post_sse(url, body, headers, timeout_s))
        return _from_stream(events, chat, time.monotonic() - start)
    resp = post_json(url, body, headers, timeout_s)
    return _from_response(resp, chat, time.monotonic() - start)


def _body(model: str, max_tokens: int, stream: bool, extra: Mapping[str, Any] | None) -> dict:
    # Greedy, fixed length: outputs are comparable token for token across servers.
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    body.update(extra or {})
    return body


def complete(
    base_url: str,
    prompt: str | list[int],
    *,
    model: str,
    max_tokens: int = 16,
    stream: bool = False,
    extra: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Generation:
    """POST ``/v1/completions`` (greedy); ``extra`` adds or overrides body fields."""
    body = _body(model, max_tokens, stream, extra)
    body["prompt"] = prompt
    return _generate(base_url, "/v1/completions", body, False, headers, timeout_s)


def send_leg(
    base_url: str,
    prompt: str | list[int],
    kv_transfer_params: Mapping[str, Any],
    request_id: str,
    *,
    model: str,
    max_tokens: int,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Generation:
    """One leg of a P/D request as a router sends it: a greedy ``complete`` carrying the leg's
    kv_transfer_params, the two legs of a request sharing ``request_id`` as X-Request-Id."""
    return complete(
        base_url,
        prompt,
        model=model,
        max_tokens=max_tokens,
        extra={"kv_transfer_params": dict(kv_transfer_params)},
        headers={"X-Request-Id": request_id},
        timeout_s=timeout_s,
    )


def chat(
    base_url: str,
    messages: Sequence[Mapping[str, str]],
    *,
    model: str,
    max_tokens: int = 16,
    stream: bool = False,
    extra: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Generation:
    """POST ``/v1/chat/completions`` (greedy); ``extra`` adds or overrides body fields."""
    body = _body(model, max_tokens, stream, extra)
    body["messages"] = [dict(m) for m in messages]
    return _generate(base_url, "/v1/chat/completions", body, True, headers, timeout_s)


def read_metrics(base_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """Parse a Prometheus ``/metrics`` page into ``{"name{labels}": value}``."""
    with _request(base_url.rstrip("/") + "/metrics", None, None, timeout_s) as resp:
        text = resp.read().decode(errors="replace")
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            samples[name] = float(value)
        except ValueError:
            continue
    return samples


def metric_total(samples: Mapping[str, float], name: str, **labels: str) -> float:
    """Sum of every sample of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total
