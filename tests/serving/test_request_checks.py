"""What the serving fronts refuse before any work, and how: stop strings held back in linear
time, prompts too long for the model refused after encoding a part of them, text that is not
valid Unicode, and bodies Triton's own JSON parser would answer with a server error. Each
expected value is written out by hand or computed by a brute-force definition."""

from __future__ import annotations

import json
import random

import pytest

from moedeploy.runtime.text import PREFIX_CHARS_PER_TOKEN, StopStrings, TextCodec, TextError
from moedeploy.serving.generate_body import checked_generate_body, error_message, error_status
from moedeploy.serving.openai_api import ApiError, ServedModel, parse_request
from tests.text_helpers import export_with_tokenizer


def held_by_definition(unsent: str, stops: list[str]) -> str:
    """The longest tail of the unsent text that is a proper prefix of some stop string."""
    keep = max((n for s in stops for n in range(1, min(len(s), len(unsent) + 1)) if unsent.endswith(s[:n])), default=0)
    return unsent[len(unsent) - keep:]


@pytest.mark.parametrize("seed", range(6))
def test_the_held_tail_is_the_longest_proper_prefix_of_a_stop_string(seed: int) -> None:
    """Random pieces over a two-letter alphabet, stop strings that overlap themselves (abab,
    aab): after every push, what is held back is what the definition says, and what was sent
    plus what is held is the text so far."""
    rng = random.Random(seed)
    stops = ["".join(rng.choice("ab") for _ in range(rng.randint(2, 7))) for _ in range(rng.randint(1, 3))]
    stops = [s + "c" for s in stops]  # never completed: only holding is exercised
    matcher, text, sent = StopStrings(stops), "", ""
    for _ in range(200):
        piece = "".join(rng.choice("ab") for _ in range(rng.randint(0, 4)))
        text += piece
        sent += matcher.push(piece)
        assert sent + matcher.held == text
        assert matcher.held == held_by_definition(text[len(sent):], stops), (stops, text)


def test_a_long_stop_string_is_held_and_then_found() -> None:
    """A 2,000-character stop string fed a character at a time (the quadratic search this
    replaces took seconds a token here): all of it is held until its last character ends it."""
    stop = "a" * 1999 + "b"
    matcher = StopStrings([stop])
    assert all(matcher.push("a") == "" for _ in range(1999))
    assert matcher.push("a") == "a" and len(matcher.held) == 1999  # 2,000 a's: the first can go
    assert matcher.push("b") == "" and matcher.stopped


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> ServedModel:
    _, artifact = export_with_tokenizer(tmp_path_factory.mktemp("checks"), seed=3)
    return ServedModel("decoder", TextCodec.from_artifact(artifact), 0, 64)


def test_a_prompt_far_longer_than_the_model_is_refused_from_a_part_of_it(model: ServedModel) -> None:
    codec = model.codec
    text = "the cat sat on the mat " * 400  # 9,200 characters, well over 8 x 64
    assert len(codec.encode(text)) > 64 + 16
    with pytest.raises(TextError, match=r"^the prompt is longer than the model's 64 positions: its first 512 "
                                        r"characters alone are \d+ tokens$"):
        codec.encode(text, max_tokens=64)
    short = "the cat sat on the mat"
    assert len(short) < PREFIX_CHARS_PER_TOKEN * 64
    assert codec.encode(short, max_tokens=64) == codec.tokenizer.encode(short).ids
    # 13 characters a token (a special token written out): the first part fits, a 4 times longer one not
    specials = "<|assistant|>" * 5000
    with pytest.raises(TextError, match=r"its first 2,048 characters alone are \d+ tokens$"):
        codec.encode(specials, max_tokens=64)


def test_a_lone_surrogate_is_refused_as_text(model: ServedModel) -> None:
    with pytest.raises(TextError, match=r"the prompt holds '\\ud800' at character 3, a lone surrogate"):
        model.codec.encode("abc\ud800")
    with pytest.raises(TextError, match=r"messages\[0\]\.content holds '\\udfff' at character 0"):
        model.codec.chat_ids([{"role": "user", "content": "\udfff"}])


def refusal(body: dict, model: ServedModel, chat: bool = False) -> tuple[str, str | None]:
    with pytest.raises(ApiError) as e:
        parse_request({"model": "decoder", **body}, {"decoder": model}, chat)
    return str(e.value), e.value.param


def test_openai_requests_the_server_cannot_honour_are_refused_naming_the_field(model: ServedModel) -> None:
    prompt = {"prompt": "the cat"}
    assert refusal({**prompt, "n": True}, model) == ("n must be an integer, got true", "n")
    assert refusal({**prompt, "n": 0}, model) == ("n must be 1: this server makes one choice per request", "n")
    assert refusal({**prompt, "stop": 0}, model)[1] == "stop"
    assert refusal({**prompt, "stop": False}, model)[1] == "stop"
    assert refusal({**prompt, "stop": "x" * 1001}, model) == (
        "a stop string has 1,001 characters; the most is 1000", "stop")
    assert refusal({**prompt, "stop": ["ok", "\ud800"]}, model)[1] == "stop"
    assert refusal({**prompt, "seed": 2**64}, model) == (
        "seed must be an integer in int64's range, got 18446744073709551616", "seed")
    for top_p in (0, 1.5, -0.2):  # refused here, naming the field, not later by the stream model with no field
        assert refusal({**prompt, "top_p": top_p}, model) == (f"top_p must be in (0, 1], got {top_p}", "top_p")
    assert refusal({**prompt, "stream_options": {"include_usage": True}}, model) == (
        "stream_options is only allowed when stream is true", "stream_options")
    assert refusal({**prompt, "stream": True, "stream_options": [1]}, model)[1] == "stream_options"
    assert refusal({**prompt, "stream": True, "stream_options": {"include_usage": "x"}}, model) == (
        'stream_options.include_usage must be true or false, got "x"', "stream_options")
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    assert refusal({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]}, model,
                   chat=True) == ('messages[0].content[1] is a "image_url" part; this server takes text only', "messages")
    assert refusal({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, model, chat=True) == (
        'messages[0].content[0] is a text part without a "text" string', "messages")
    assert refusal({**prompt, "max_tokens": 2**70}, model)[1] == "max_tokens"
    assert refusal({**prompt, "temperature": float("nan")}, model) == (
        "temperature must be a number within float32's range, got nan", "temperature")
    # logprobs 0 asks the completions API for the chosen tokens' log probabilities (it answered
    # "logprobs": null), and a tool_choice without tools was passed over in silence
    for field, value in [("logit_bias", {"5": 10}), ("frequency_penalty", 0.5), ("presence_penalty", -1),
                         ("response_format", {"type": "json_object"}), ("logprobs", True), ("logprobs", 0),
                         ("tool_choice", "auto"), ("function_call", "auto")]:
        assert refusal({**prompt, field: value}, model) == (
            f"{field} is not supported by this server; leave it out", field)
    assert refusal({**prompt, "top_p": 1e-300}, model) == (  # 0 as the float32 the stream model reads
        "top_p must be in (0, 1], got 1e-300, which is 0 as a float32", "top_p")
    assert refusal({"messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}]},
                   model, chat=True) == ("messages[1] holds tool_calls: this server does not take tool calls", "messages")
    generation = parse_request({"model": "decoder", "max_tokens": 2, "messages": [  # an empty list asks for none
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "tool_calls": []},
        {"role": "user", "content": "bye"}]}, {"decoder": model}, chat=True)
    assert generation.max_tokens == 2
    assert refusal({"prompt": "ab\ud800"}, model)[1] == "prompt"
    assert refusal({"messages": [{"role": "wizard", "content": "hi"}]}, model, chat=True) == (
        "messages[0].role is \"wizard\"; use one of system, developer, user, assistant, tool, function", "messages")
    n = len(model.codec.encode("the cat"))
    assert refusal({**prompt, "max_tokens": 64 - n + 1}, model) == (
        f"the prompt ({n} tokens) and max_tokens ({64 - n + 1}) come to more than the model's 64 positions; "
        "shorten the prompt or ask for fewer tokens", "max_tokens")


def test_openai_chat_content_as_text_parts_is_the_parts_joined_by_newlines(model: ServedModel) -> None:
    """OpenAI's API takes a message's content as a list of text parts too; the prompt is the
    template rendered on the parts' texts joined by newlines (vLLM's reading of it)."""
    parts = [{"type": "text", "text": "the cat"}, {"type": "text", "text": "sat"}]
    generation = parse_request({"model": "decoder", "messages": [{"role": "user", "content": parts}], "max_tokens": 2},
                               {"decoder": model}, chat=True)
    assert generation.ids == model.codec.chat_ids([{"role": "user", "content": "the cat\nsat"}])
    assert generation.include_usage is False


def test_openai_neutral_values_and_top_k_pass(model: ServedModel) -> None:
    generation = parse_request({"model": "decoder", "prompt": "the cat", "max_tokens": 3, "logit_bias": {},
                                "frequency_penalty": 0, "presence_penalty": 0.0, "response_format": {"type": "text"},
                                "logprobs": False, "n": 1, "top_k": 5, "seed": -(2**63), "stop": [],
                                "tool_choice": "none", "top_p": 1e-30},
                               {"decoder": model}, chat=False)
    assert generation.options == {"temperature": 1.0, "top_p": 1e-30, "top_k": 5, "seed": -(2**63)}
    assert generation.ids == model.codec.encode("the cat") and generation.max_tokens == 3


@pytest.mark.parametrize(("body", "expected"), [
    (b"{not json", "the request body is not valid JSON: Expecting property name enclosed in double quotes: "
                   "line 1 column 2 (char 1)"),
    (b"\xff\xfe", "the request body is not UTF-8 text"),
    (b"[1, 2]", "the request body must be a JSON object of input names to values"),
    (b'{"text_input": 5}', "text_input must be a string"),
    (b'{"text_input": "\\ud800"}', "text_input holds a lone surrogate, which is not valid Unicode text"),
    (b'{"stop": ["a", 1]}', "stop must be a string or a list of strings"),
    (b'{"input_ids": [1, 2.5]}', "input_ids must hold integer token ids, got 2.5"),
    (b'{"input_ids": [[1, 2, 3]]}', "input_ids must be a flat list of token ids: the generate endpoint takes one "
                                    "sequence"),
    (b'{"input_ids": 7}', "input_ids must be a list of token ids"),
    (b'{"input_ids": [1, true]}', "input_ids must hold integer token ids, got true"),
    (b'{"max_tokens": "3"}', 'max_tokens must be an integer in int64\'s range, got "3"'),
    (b'{"seed": 18446744073709551615}', "seed must be an integer in int64's range, got 18446744073709551615"),
    (b'{"temperature": 1e300}', "temperature must be a number within float32's range, got 1e+300"),
    (b'{"parameters": 5}', '"parameters" must be a JSON object'),
    (b'{"parameters": {"moedeploy_refused": "x"}}', "the parameter 'moedeploy_refused' is the server's own; leave it out"),
])
def test_generate_bodies_triton_would_answer_500_get_one_line(body: bytes, expected: str) -> None:
    assert checked_generate_body(body, "decoder_stream", "generate_stream", ("id", "1")) == (body, expected)


def test_good_generate_bodies_pass_with_the_request_id_and_the_stream_model_wants_generate_stream() -> None:
    """Triton forwards no header through its generate extension, so the front writes the request
    id into the body's "parameters" (which Triton hands the model), in the same pass that checks it."""
    good = {"text_input": "hi", "max_tokens": 4, "temperature": 0.5, "stop": ["\n"], "seed": 2**63 - 1,
            "parameters": {"priority": 1}}
    body, problem = checked_generate_body(json.dumps(good).encode(), "decoder_stream", "generate_stream", ("id", "ab"))
    assert problem is None and json.loads(body) == {**good, "parameters": {"priority": 1, "id": "ab"}}
    # one-element arrays for one-value inputs, as Triton takes them
    body, problem = checked_generate_body(b'{"input_ids": [1, 2, 3], "max_new_tokens": [3]}', "decoder_generate",
                                          "generate", ("id", "cd"))
    assert problem is None and json.loads(body) == {"input_ids": [1, 2, 3], "max_new_tokens": [3],
                                                    "parameters": {"id": "cd"}}
    assert checked_generate_body(b"{}", "decoder_stream", "generate", ("id", "x"))[1] == (
        "decoder_stream sends a response per token: POST to /v2/models/decoder_stream/generate_stream, or to "
        "/v2/models/decoder_generate/generate for one answer")


def test_a_generate_body_is_bounded_by_the_prompt_the_model_takes() -> None:
    """2,048 positions as ids of 21 characters each (the longest int64 and a comma) fit, with room."""
    from moedeploy.serving.generate_body import generate_body_limit

    longest = json.dumps({"input_ids": [-(2**63)] * 2048, "max_tokens": 1, "stop": ["x" * 1000] * 16}).encode()
    assert len(longest) < generate_body_limit(2048, 1) == 2048 * 64 + 2**20
    assert generate_body_limit(2048, 4) == 4 * 2048 * 64 + 2**20


def test_error_answers_read_as_one_line_and_busy_is_503() -> None:
    sse = b'data: {"error":"the server is busy: 1 sequences running and 1 waiting (the limits); retry later"}\n\n'
    assert error_message(sse) == "the server is busy: 1 sequences running and 1 waiting (the limits); retry later"
    assert error_status(400, error_message(sse)) == 503
    assert error_message(b'{"error": "prompt (3 tokens) + max_tokens (9) exceeds max_positions 8\\nmore"}') == (
        "prompt (3 tokens) + max_tokens (9) exceeds max_positions 8")
    assert error_status(400, "prompt (3 tokens) + max_tokens (9) exceeds max_positions 8") == 400
    assert error_status(400, "the server is shutting down; retry on another replica") == 503
    assert error_message(b"plain words\nsecond") == "plain words"


def test_only_empty_stop_strings_hold_nothing_back() -> None:
    matcher = StopStrings(["", ""])
    assert (matcher.push("abc"), matcher.flush(), matcher.stopped) == ("abc", "", False)


def test_an_inference_body_is_checked_within_bounded_time() -> None:
    """infer_body: a JSON part up to PARSED_JSON_BYTES is parsed and every input's values
    counted; past it (parsing holds the GIL, stalling the front's loop) only the declared shapes
    are held to the body's size, which still refuses the shape that made Triton allocate 25 GB.
    A length header that is not ASCII digits ("²" is a digit to str.isdigit, not to int) is a
    400, not an exception."""
    from moedeploy.serving.infer_body import (
        JSON_LENGTH_HEADER,
        PARSED_JSON_BYTES,
        infer_body_problem,
    )

    values = PARSED_JSON_BYTES // 4  # "0.5," is 4 bytes a value: a body past the parsed size
    good = json.dumps({"inputs": [{"name": "x", "shape": [1, values // 64, 64], "datatype": "FP32",
                                   "data": [0.5] * (values // 64 * 64)}]}).encode()
    assert len(good) > PARSED_JSON_BYTES and infer_body_problem(good, None) is None
    lie = good.replace(b'"shape": [1, ', b'"shape": [100000, ', 1)
    assert infer_body_problem(lie, None) == (
        f"a shape declares {100000 * (values // 64) * 64:,} values, more than the {len(lie):,}-byte request can hold; "
        "send as many values as the shape holds")
    small = json.dumps({"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]}).encode()
    assert infer_body_problem(small, None) is None
    assert infer_body_problem(small + b"\x00\x01", str(len(small))) is None  # binary data after the JSON part
    for header in ("\u00b2", "-1", "12a", str(len(small) + 3)):
        assert infer_body_problem(small, header) == (
            f"{JSON_LENGTH_HEADER} must be the length of the body's JSON part, at most {len(small)}"), header


def test_a_large_body_is_checked_whole_in_a_child_process() -> None:
    """Past PARSED_JSON_BYTES the front reads only the declared shapes; when Triton then answers
    500, whole_body_problem parses the body in a child Python and names the first wrong value, of
    a million, as the small-body check does."""
    import asyncio

    from moedeploy.serving.infer_body import (
        PARSED_JSON_BYTES,
        checked_partly,
        infer_body_problem,
        whole_body_problem,
    )

    values = [7] * 1_000_000
    values[600_001], values[900_000] = 2.5, "x"  # the first wrong one is named
    body = json.dumps({"inputs": [{"name": "ids", "shape": [1000, 1000], "datatype": "INT64",
                                   "data": [values[i:i + 1000] for i in range(0, 1_000_000, 1000)]}]}).encode()
    assert len(body) > PARSED_JSON_BYTES and checked_partly(body, None)
    message = f"inputs[0] (ids): data holds 2.5, which is not of datatype INT64; {INT64_RANGE}"
    assert infer_body_problem(body, None) is None  # the shapes alone fit the body
    assert infer_body_problem(body, None, whole=True) == message
    assert asyncio.run(whole_body_problem(body, None)) == message
    binary = body + bytes(3 * 2**20)  # binary tensors after a small JSON part: that part was parsed whole
    assert not checked_partly(binary, str(len(b"{}"))) and checked_partly(binary, None)
    assert asyncio.run(whole_body_problem(b"{}" + bytes(8), "2")) == \
        '"inputs" must be a non-empty list of input objects ({"name", "shape", "datatype", "data"})'


def test_a_large_body_check_never_queues_and_has_a_time_limit(monkeypatch, caplog) -> None:
    """While one large body is being checked, another 500 passes through unchecked at once (a
    client sending such bodies cannot hold others' answers, or their bodies, behind its own);
    a check past WHOLE_CHECK_S is given up, and Triton's answer stands."""
    import asyncio
    import logging

    from moedeploy.serving import front
    from moedeploy.serving.front import CancelledRequests, HttpFront

    started: list[float] = []

    async def slow_check(body, json_length):
        started.append(len(body))
        await asyncio.sleep(60)

    monkeypatch.setattr(front, "whole_body_problem", slow_check)
    monkeypatch.setattr(front, "WHOLE_CHECK_S", 0.5)
    proxy = HttpFront("127.0.0.1", 0, "http://127.0.0.1:1", 2**20, [], CancelledRequests())

    async def scenario():
        proxy._whole_checks = asyncio.Semaphore(1)
        first = asyncio.ensure_future(proxy._whole_body_problem(bytearray(10), None))
        await asyncio.sleep(0.05)
        second = await asyncio.wait_for(proxy._whole_body_problem(bytearray(20), None), 0.2)  # not queued
        return second, await first

    with caplog.at_level(logging.INFO, logger="moedeploy.serving"):
        assert asyncio.run(scenario()) == (None, None)
    assert started == [10]
    messages = [r.getMessage() for r in caplog.records]
    assert any("20-byte inference body Triton refused passes its answer on unchecked" in m for m in messages), messages
    assert any("could not check a 10-byte inference body Triton refused: no answer in 0.5 s" in m for m in messages)


def test_counting_values_agrees_with_a_plain_recursive_walk() -> None:
    """count_values judges lists whole, walks rows in turn and halves a refused list of values:
    on random nested data of every JSON type its count and first wrong value are a recursive
    walk's, value by value in document order."""
    from moedeploy.serving.infer_body import _all_valid, count_values

    def walk(data, ok):
        """(values before the first wrong one, (it,) or ()), one value at a time."""
        if not isinstance(data, list):
            return (1, ()) if ok is None or ok([data]) else (0, (data,))
        count = 0
        for item in data:
            n, wrong = walk(item, ok)
            count += n
            if wrong:
                return count, wrong
        return count, ()

    rng = random.Random(0)
    values = [0, 1, -5, 255, 256, 2**63, -(2**63) - 1, 2.5, True, False, None, "a", float("nan")]

    def data(depth):
        if depth == 0 or rng.random() < 0.3:
            return rng.choice(values)
        return [data(depth - 1) for _ in range(rng.randrange(0, 6))]

    for datatype in ("INT64", "UINT8", "FP32", "BOOL", "BYTES", "INT8", "UNKNOWN"):
        ok = _all_valid(datatype)
        for _ in range(400):
            sample = data(4)
            got, expected = count_values(sample, ok), walk(sample, ok)
            assert got[0] == expected[0] and repr(got[1]) == repr(expected[1]), (datatype, sample)


INT64_IDS = {"name": "input_ids", "shape": [1, 3], "datatype": "INT64", "data": [5, 6, 7]}
INT64_RANGE = "send integers from -9223372036854775808 to 9223372036854775807"


@pytest.mark.parametrize(("body", "expected"), [
    ({"inputs": [{**INT64_IDS, "data": ["a", 6, 7]}]},
     f'inputs[0] (input_ids): data holds "a", which is not of datatype INT64; {INT64_RANGE}'),
    ({"inputs": [{**INT64_IDS, "data": [[5, 6.5, 7]]}]},
     f"inputs[0] (input_ids): data holds 6.5, which is not of datatype INT64; {INT64_RANGE}"),
    ({"inputs": [{**INT64_IDS, "data": [5, True, 7]}]},
     f"inputs[0] (input_ids): data holds true, which is not of datatype INT64; {INT64_RANGE}"),
    ({"inputs": [{**INT64_IDS, "data": [None, 6, 7]}]},
     f"inputs[0] (input_ids): data holds null, which is not of datatype INT64; {INT64_RANGE}"),
    ({"inputs": [{**INT64_IDS, "data": [2**63, 6, 7]}]},
     f"inputs[0] (input_ids): data holds {2**63}, which is not of datatype INT64; {INT64_RANGE}"),
    ({"inputs": [{"name": "x", "shape": [2], "datatype": "UINT8", "data": [3, 256]}]},
     "inputs[0] (x): data holds 256, which is not of datatype UINT8; send integers from 0 to 255"),
    ({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1.5, "hot"]}]},
     'inputs[0] (x): data holds "hot", which is not of datatype FP32; send numbers'),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "BOOL", "data": [1]}]},
     "inputs[0] (x): data holds 1, which is not of datatype BOOL; send true or false"),
    ({"inputs": [{**INT64_IDS, "name": 5}]}, 'inputs[0]: "name" must be a string'),
    ({"inputs": [{**INT64_IDS, "datatype": 5}]},
     'inputs[0] (input_ids): "datatype" must be a string, such as "INT64" or "FP32"'),
    ({"inputs": [INT64_IDS], "outputs": [{"name": 5}]}, '"outputs" must be a list of objects, each with a "name" string'),
    ({"inputs": [INT64_IDS], "parameters": {"binary_data_output": "yes"}},
     'the request\'s parameter "binary_data_output" must be true or false, got "yes"'),
    ({"inputs": [INT64_IDS], "outputs": [{"name": "y", "parameters": {"binary_data": 1}}]},
     'outputs[0]\'s parameter "binary_data" must be true or false, got 1'),
    ({"inputs": [{**INT64_IDS, "parameters": {"binary_data_size": "24"}}]},
     'inputs[0]\'s parameter "binary_data_size" must be a non-negative integer, got "24"'),
])
def test_inference_values_of_the_wrong_json_type_get_one_line(body: dict, expected: str) -> None:
    """Triton's JSON parser answered each of these 500 ("attempt to access JSON non-number as
    double"), a server error for the client's mistake."""
    from moedeploy.serving.infer_body import infer_body_problem

    assert infer_body_problem(json.dumps(body).encode(), None) == expected


def test_inference_values_of_their_datatype_pass() -> None:
    from moedeploy.serving.infer_body import infer_body_problem

    good = {"inputs": [{**INT64_IDS, "data": [[-(2**63), 0, 2**63 - 1]]},
                       {"name": "x", "shape": [3], "datatype": "FP32", "data": [1, 2.5, -1e30]},
                       {"name": "b", "shape": [2], "datatype": "BOOL", "data": [True, False]},
                       {"name": "s", "shape": [1], "datatype": "BYTES", "data": ["text"]},
                       {"name": "u", "shape": [2], "datatype": "UINT8", "data": [0, 255],
                        "parameters": {"binary_data_size": 0}}],
            "outputs": [{"name": "y", "parameters": {"binary_data": True, "classification": 2}}],
            # a request's own parameters of those names are the model's (tritonclient's custom_parameters)
            "parameters": {"binary_data_output": False, "classification": "top", "binary_data": "x"}}
    assert infer_body_problem(json.dumps(good).encode(), None) is None
    nested = {"inputs": [{**INT64_IDS, "data": [[1, 2, 3]]}, {"name": "x", "shape": [2, 2], "datatype": "FP32",
                                                           "data": [[1, 2.5], [3, -4.0]]}]}
    assert infer_body_problem(json.dumps(nested).encode(), None) is None
