"""The Gemini provider: its endpoints, the request fields it reads, usage in deja's names
and its cost, and a stream asked for without ``alt=sse``."""

from __future__ import annotations

import json

from recorder import providers
from recorder.providers.gemini import GeminiProvider, model_of_url, normalized_usage
from recorder.providers.pricing import PriceTable

MODEL = "gemini-2.5-flash"
USAGE = {"input_tokens": 120, "output_tokens": 9, "cache_read_input_tokens": 300}
# gemini-2.5-flash: $0.30 in, $2.50 out, $0.03 a cached token
COST = round((120 * 0.30 + 9 * 2.50 + 300 * 0.03) / 1_000_000, 8)
SEAM = providers.get("gemini")


# ------------------------------------------------------------------------ the seam


def test_the_endpoints_are_gemini_calls_at_any_host_and_version() -> None:
    for url in ("https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-flash"
                ":generateContent",
                "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-flash"
                ":streamGenerateContent?alt=sse",
                "https://us-central1-aiplatform.googleapis.com/v1/projects/p/locations/"
                "us-central1/publishers/google/models/gemini-2.5-pro:generateContent"):
        assert isinstance(providers.for_url("POST", url), GeminiProvider), url
    base = "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-flash"
    assert providers.for_url("POST", f"{base}:countTokens") is None
    assert providers.for_url("GET", f"{base}:generateContent") is None
    assert model_of_url(f"{base}:streamGenerateContent?alt=sse") == "gemini-2.5-flash"
    assert model_of_url("https://h/v1beta/tunedModels/x:generateContent") is None
    body = {"contents": [], "generationConfig": {"temperature": 0, "maxOutputTokens": 900}}
    assert SEAM.request_model(body) is None  # the body does not name it
    assert SEAM.request_model(body, f"{base}:generateContent") == "gemini-2.5-flash"
    assert SEAM.request_streams(body, f"{base}:streamGenerateContent?alt=sse")
    assert not SEAM.request_streams(body, f"{base}:generateContent")
    assert SEAM.request_max_tokens(body) == 900 and SEAM.request_max_tokens({}) is None
    assert SEAM.with_max_tokens(body, 64)["generationConfig"] == {"temperature": 0,
                                                                  "maxOutputTokens": 64}
    assert SEAM.with_max_tokens({"contents": []}, 64)["generationConfig"] == \
        {"maxOutputTokens": 64}
    assert SEAM.history_field(body) == "contents" == providers.history_field(body)
    assert SEAM.is_volatile_header("x-goog-api-client") and SEAM.is_volatile_header("Host")
    assert not SEAM.is_volatile_header("x-goog-api-key")  # stored, as [redacted]
    assert providers.placeholder_keys({})["GEMINI_API_KEY"] == providers.PLACEHOLDER_KEY


def test_usage_is_normalised_to_deja_names_and_priced() -> None:
    meta = {"promptTokenCount": 420, "candidatesTokenCount": 7, "thoughtsTokenCount": 2,
            "cachedContentTokenCount": 300, "totalTokenCount": 429}
    assert normalized_usage(meta) == USAGE
    assert normalized_usage({**meta, "toolUsePromptTokenCount": 5})["input_tokens"] == 125
    assert normalized_usage({"promptTokenCount": 7}) == {"input_tokens": 7}
    assert normalized_usage({"promptTokenCount": "7", "candidatesTokenCount": True}) == {}
    assert SEAM.cost(MODEL, USAGE, PriceTable()) == COST
    assert SEAM.cost("gemini-2.5-flash-lite-preview-09-2025", USAGE, PriceTable()) == \
        round((120 * 0.10 + 9 * 0.40 + 300 * 0.01) / 1_000_000, 8)
    error = SEAM.summarize(429, [], b'{"error": {"code": 429, "message": "slow down", '
                                    b'"status": "RESOURCE_EXHAUSTED"}}')
    assert error == {"error": {"type": "RESOURCE_EXHAUSTED", "message": "slow down"}}
    assert SEAM.summarize(200, [], b"\xff") == {} and SEAM.summarize(200, [], b"[1") == {}
    blocked = {"promptFeedback": {"blockReason": "SAFETY"}, "usageMetadata": meta}
    assert SEAM.stop_reason(blocked) == "SAFETY"


def test_a_stream_asked_without_sse_is_a_json_array_of_chunks() -> None:
    chunks = [{"candidates": [{"content": {"role": "model", "parts": [{"text": "Hel"}]},
                               "index": 0}], "responseId": "r1", "modelVersion": MODEL},
              {"candidates": [{"content": {"role": "model", "parts": [{"text": "lo"}]},
                               "finishReason": "STOP", "index": 0}],
               "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 2},
               "responseId": "r1", "modelVersion": MODEL}]
    body = json.dumps(chunks).encode()
    headers = [("content-type", "application/json")]
    message = SEAM.message(headers, body.decode())
    assert message["candidates"][0]["content"]["parts"] == [{"text": "Hello"}]
    assert SEAM.summarize(200, headers, body) == {
        "message_id": "r1", "model": MODEL, "stop_reason": "STOP",
        "usage": {"input_tokens": 3, "output_tokens": 2}}
    assert SEAM.summarize_parsed(200, headers, body, chunks) == SEAM.summarize(200, headers,
                                                                               body)
