"""The chat-completions / completions request checks of `kvtool serve` (pydantic models,
`kvtool.server.validation`): what they refuse, with which status and message, and what they
normalise. No server: `check_request` is what the handler calls before mlx-lm sees a body."""

from __future__ import annotations

import copy

import pytest

from kvtool.server.validation import Limits, RequestError, check_request

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
LIMITS = Limits(max_tokens_cap=100, max_prompt_tokens=1000, vocab_size=1000, model_names=("default_model", "m"))
HI = [{"role": "user", "content": "hi"}]


def refused(body: dict, path: str = CHAT, limits: Limits = LIMITS) -> RequestError:
    with pytest.raises(RequestError) as info:
        check_request(copy.deepcopy(body), path, limits)
    return info.value


@pytest.mark.parametrize("body, path, status, message", [
    ({"messages": HI, "max_tokens": 101}, CHAT, 400, "max_tokens: Input should be less than or equal to 100"),
    ({"messages": HI, "max_tokens": True}, CHAT, 400, "max_tokens: Input should be a valid integer"),
    ({"messages": HI, "temperature": float("inf")}, CHAT, 400, "temperature: Input should be a finite number"),
    ({"messages": HI, "temperature": -0.5}, CHAT, 400, "temperature: Input should be greater than or equal to 0"),
    ({"messages": HI, "top_p": 1.5}, CHAT, 400, "top_p: Input should be less than or equal to 1"),
    ({"messages": HI, "top_k": 1001}, CHAT, 400, "top_k: Input should be less than or equal to 1000"),
    ({"messages": HI, "repetition_context_size": 1101}, CHAT, 400, "repetition_context_size: Input should be less"),
    ({"messages": HI, "stop": 5}, CHAT, 400, "stop: must be a string or a list"),
    ({"messages": HI, "stop": ["s"] * 17}, CHAT, 400, "stop: List should have at most 16 items"),
    ({"messages": HI, "stream": 0}, CHAT, 400, "stream: Input should be a valid boolean"),
    ({"messages": HI, "stream_options": {"include_usage": "yes"}}, CHAT, 400, "stream_options.include_usage: "),
    ({"messages": HI, "stream_options": True}, CHAT, 400, "stream_options: must be an object"),
    ({"messages": HI, "logit_bias": {"1000": 1.0}}, CHAT, 400, "logit_bias: keys must be token ids (0 to 999), got '1000'"),
    ({"messages": HI, "logit_bias": {"7": "a"}}, CHAT, 400, "logit_bias.7: Input should be a valid number"),
    ({"messages": HI, "tools": [5]}, CHAT, 400, "tools[0]: must be an object"),
    ({"messages": []}, CHAT, 400, "messages: List should have at least 1 item"),
    ({"messages": [5]}, CHAT, 400, "messages[0]: must be an object"),
    ({"messages": [{"role": 1}]}, CHAT, 400, "messages[0].role: Input should be a valid string"),
    ({"messages": [{"role": "user", "content": 5}]}, CHAT, 400, "messages[0].content: must be a string or a list"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, CHAT, 400, "messages[0].content[0].text: Field required"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, CHAT, 400,
     "messages[0].content[0]: content type 'video' is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}, CHAT, 400,
     "messages[0].content[0]: this model does not take images"),
    ({"messages": [{"role": "user", "content": [5]}]}, CHAT, 400, "messages[0].content[0]: must be an object with a string type"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": 5}]}]}, CHAT, 400,
     "messages[0].tool_calls[0].function: must be an object"),
    ({"prompt": ""}, COMPLETIONS, 400, "prompt: String should have at least 1 character"),
    ({"prompt": ["tokens"]}, COMPLETIONS, 400, "prompt: Input should be a valid string"),
    ({"messages": HI, "model": "other"}, CHAT, 404, "model 'other' is not served here"),
    ({"messages": HI, "draft_model": "d"}, CHAT, 404, "draft_model: this server has no draft model"),
])
def test_refusals_name_the_field_and_the_rule(body, path, status, message):
    err = refused(body, path)
    assert (err.status, err.message[: len(message)]) == (status, message), err.message
    for leak in ("instance of", "Value error", "constrained-", "_Part", "_Tool"):  # pydantic's internals
        assert leak not in err.message


def test_image_parts_pass_where_the_model_takes_images():
    images = Limits(model_names=("default_model",), images=True)
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}]}
    assert check_request(copy.deepcopy(body), CHAT, images) == body
    body["messages"][0]["content"][0]["image_url"] = 5
    assert refused(body, CHAT, images).message.startswith("messages[0].content[0]: the image url must be a string")


def test_accepted_bodies_are_normalised_for_mlx_lm():
    body = {"messages": HI, "temperature": None, "stop": ["", "x"], "stream_options": {}, "extra_field": [1],
            "logit_bias": {" 7 ": -1}, "tools": [{"type": "function", "function": {"name": "f"}}]}
    out = check_request(body, CHAT, LIMITS)
    assert out is body  # in place: the handler passes the same dict on
    assert "temperature" not in out and out["stop"] == ["x"]
    assert out["stream_options"] == {"include_usage": False} and out["extra_field"] == [1]
    assert check_request({"prompt": "p", "max_tokens": 100}, COMPLETIONS, LIMITS)["max_tokens"] == 100
