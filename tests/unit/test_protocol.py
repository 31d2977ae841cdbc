"""Wire protocol v1: the committed JSON Schema and the pydantic models must agree.

Producers in other languages validate against ``qlm/schemas/protocol-v1.schema.json``; the
coordinator validates with :mod:`qlm.types`. These tests check that the file is what the code
generates, and that the two validators accept and reject the same requests.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator, ValidationError
from pydantic import ValidationError as PydanticValidationError
from referencing import Registry, Resource

import qlm
from qlm.types import (
    MAX_TOKEN_ID,
    SLO,
    BatchedChunk,
    ChatMessage,
    ErrorCode,
    ErrorMessage,
    RequestMessage,
    ResultMessage,
    SamplingParams,
    SLOOutcome,
    TaskInfo,
    Timestamps,
    TokenBatch,
    TokenChunk,
    Usage,
    protocol_json_schema,
)

SCHEMA_PATH = Path(qlm.__file__).parent / "schemas" / "protocol-v1.schema.json"


def schema_text() -> str:
    """What ``qlm schema`` prints: pretty JSON, sorted keys, trailing newline."""
    return json.dumps(protocol_json_schema(), indent=2, sort_keys=True) + "\n"


def _ecma_pattern(
    validator: Any, pattern: str, instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    # JSON Schema patterns are ECMA-262 regexes, where an unflagged ``$`` matches only at the very
    # end. Python's ``re`` also matches ``$`` before a final newline, so plain jsonschema would
    # accept the request id "a\n", which pydantic (and a JavaScript validator) reject.
    if not validator.is_type(instance, "string"):
        return
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1] + r"\Z"
    if not re.search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


EcmaValidator = jsonschema.validators.extend(Draft202012Validator, {"pattern": _ecma_pattern})


def _validator(definition: str) -> Any:
    schema = json.loads(SCHEMA_PATH.read_text())
    registry: Registry[Any] = Registry().with_resource(
        schema["$id"], Resource.from_contents(schema)
    )
    return EcmaValidator({"$ref": f"{schema['$id']}#/$defs/{definition}"}, registry=registry)


REQUEST_VALIDATOR = _validator("RequestMessage")


def schema_accepts(doc: Any) -> bool:
    return REQUEST_VALIDATOR.is_valid(doc)


def _accepts(validate: Callable[[bytes], object], body: bytes) -> bool:
    try:
        validate(body)
    except PydanticValidationError:
        return False
    return True


def pydantic_accepts(body: bytes) -> bool:
    """pydantic's verdict, by both routes: parsing JSON directly, and ``json.loads`` followed by
    ``model_validate`` (what the coordinator does). They must agree with each other."""
    by_json = _accepts(RequestMessage.model_validate_json, body)
    by_python = _accepts(lambda b: RequestMessage.model_validate(json.loads(b)), body)
    assert by_json == by_python, f"JSON and Python validation disagree on {body!r}"
    return by_json


# --- the committed file ----------------------------------------------------------------------


def test_committed_schema_matches_the_models() -> None:
    committed = SCHEMA_PATH.read_text()
    assert committed == schema_text(), (
        "qlm/schemas/protocol-v1.schema.json is stale; regenerate it with "
        "`qlm schema > qlm/schemas/protocol-v1.schema.json`"
    )


def test_qlm_schema_prints_the_committed_file() -> None:
    from typer.testing import CliRunner

    from qlm.cli import app

    result = CliRunner().invoke(app, ["schema"])
    assert result.exit_code == 0, result.output
    assert result.stdout == SCHEMA_PATH.read_text()


def test_committed_schema_is_a_valid_draft_2020_12_schema() -> None:
    schema = json.loads(SCHEMA_PATH.read_text())
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(schema)
    assert set(schema["$defs"]) >= {"RequestMessage", "ResultMessage", "ErrorMessage"}
    codes = set(schema["$defs"]["ErrorCode"]["enum"])
    assert codes == {c.value for c in ErrorCode}


# --- strategies ------------------------------------------------------------------------------

# No lone surrogates: they cannot be encoded as UTF-8, so they never reach the broker.
TEXT = st.characters(exclude_categories=["Cs"])


def finite(
    lo: float | None = None, hi: float | None = None, *, exclude_min: bool = False
) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False, exclude_min=exclude_min)


def texts(min_size: int = 0, max_size: int = 40) -> st.SearchStrategy[str]:
    return st.text(TEXT, min_size=min_size, max_size=max_size)


@st.composite
def slos(draw: st.DrawFn) -> SLO:
    e2e, ttft = draw(
        st.sampled_from([(True, False), (False, True), (True, True)]),
    )
    e2e_ms = draw(st.integers(1, 10**7)) if e2e else None
    # the first token is never due after the last
    ttft_ms = draw(st.integers(1, e2e_ms or 10**7)) if ttft else None
    return SLO(e2e_ms=e2e_ms, ttft_ms=ttft_ms, slo_class=draw(st.none() | texts(max_size=64)))


sampling_params = st.builds(
    SamplingParams,
    temperature=finite(0.0, 2.0),
    top_p=finite(0.0, 1.0, exclude_min=True),
    top_k=st.integers(-1, 10**6),
    seed=st.none() | st.integers(-(2**63), 2**63 - 1),
    stop=st.lists(texts(max_size=8), max_size=16),
    ignore_eos=st.booleans(),
)

task_infos = st.builds(
    TaskInfo,
    task_id=texts(1, 128),
    step=st.integers(0, 1000),
    task_slo_ms=st.none() | st.integers(1, 10**8),
    task_started_at=st.none() | finite(0, 2e9, exclude_min=True),
    remaining_ms=st.none() | st.integers(0, 10**8),
)

chat_messages = st.builds(
    ChatMessage,
    role=st.sampled_from(["system", "user", "assistant", "tool"]),
    content=texts(max_size=60),
)


@st.composite
def requests(draw: st.DrawFn) -> RequestMessage:
    kind = draw(st.sampled_from(["prompt", "messages", "prompt_token_ids"]))
    value: object
    if kind == "prompt":
        value = draw(texts(max_size=200))
    elif kind == "messages":
        value = draw(st.lists(chat_messages, min_size=1, max_size=4))
    else:
        value = draw(st.lists(st.integers(0, 2**31), min_size=1, max_size=64))
    prompt: dict[str, Any] = {kind: value}
    return RequestMessage(
        request_id=draw(st.from_regex(r"[A-Za-z0-9._:@/+=-]{1,128}", fullmatch=True)),
        model=draw(texts(1, 256)),
        max_tokens=draw(st.integers(1, 10**6)),
        sampling=draw(sampling_params),
        slo=draw(slos()),
        priority=draw(st.integers(0, 9)),
        tenant=draw(st.none() | texts(max_size=128).filter(lambda t: t.isprintable())),
        submitted_at=draw(st.none() | finite(0, 2e9)),
        task=draw(st.none() | task_infos),
        **prompt,
    )


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-2, 20)
    | st.integers()
    | finite()
    | texts(max_size=10)
    | st.integers(-2, 20).map(str)  # numeric strings: pydantic's lax mode coerces them
)
json_values = json_scalars | st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(texts(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


# --- properties ------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(requests(), st.booleans())
def test_any_request_round_trips_and_both_validators_accept_it(
    req: RequestMessage, drop_nulls: bool
) -> None:
    # Producers may omit optional fields or send them as null; both must be accepted.
    body = req.model_dump_json(exclude_none=drop_nulls).encode()
    doc = json.loads(body)
    REQUEST_VALIDATOR.validate(doc)
    back = RequestMessage.model_validate_json(body)
    assert back == req
    assert back.prompt_tokens() >= 1


def _ttft_after_e2e(doc: dict[str, Any]) -> bool:
    slo = doc.get("slo")
    if not isinstance(slo, dict):
        return False
    e2e, ttft = slo.get("e2e_ms"), slo.get("ttft_ms")
    numbers = (int, float)
    return isinstance(e2e, numbers) and isinstance(ttft, numbers) and ttft > e2e


def _mutation_targets(doc: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """Every object in a request document, with the keys one could set or delete there."""
    objects: list[dict[str, Any]] = [doc]
    for key in ("slo", "sampling", "task"):
        if isinstance(doc.get(key), dict):
            objects.append(doc[key])
    messages = doc.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
        objects.append(messages[0])
    known = set(RequestMessage.model_fields) | set(SLO.model_fields)
    known |= set(SamplingParams.model_fields) | set(TaskInfo.model_fields) | {"role", "content"}
    return [(obj, key) for obj in objects for key in sorted(known | set(obj) | {"unknown"})]


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(requests(), st.data())
def test_schema_and_pydantic_agree_on_mutated_requests(
    req: RequestMessage, data: st.DataObject
) -> None:
    doc = json.loads(req.model_dump_json(exclude_none=data.draw(st.booleans())))
    for _ in range(data.draw(st.integers(1, 2), label="mutations")):
        obj, key = data.draw(st.sampled_from(_mutation_targets(doc)), label="where")
        if data.draw(st.booleans(), label="delete") and key in obj:
            del obj[key]
        else:
            obj[key] = data.draw(json_values, label=f"value of {key}")
    body = json.dumps(doc).encode()
    by_schema, by_pydantic = schema_accepts(doc), pydantic_accepts(body)
    event(f"schema {'accepts' if by_schema else 'rejects'}, pydantic {by_pydantic}")
    # A message a producer validated against the schema is never rejected by the coordinator,
    # except by the one cross-field rule JSON Schema cannot state (documented in protocol.md):
    # a TTFT deadline after the end-to-end one.
    if by_schema and not _ttft_after_e2e(doc):
        assert by_pydantic, f"schema accepts but pydantic rejects {doc!r}"
    # pydantic is lax (it coerces "5" to 5 and true to 1.0); whatever it accepts normalises to a
    # schema-valid message, so the stored and forwarded form always conforms.
    if by_pydantic:
        normalised = json.loads(RequestMessage.model_validate_json(body).model_dump_json())
        assert schema_accepts(normalised), f"pydantic accepts {doc!r} as {normalised!r}"


# --- hand-written bad inputs -----------------------------------------------------------------

GOOD: dict[str, Any] = {
    "request_id": "req-1",
    "model": "mistral-7b",
    "prompt": "Hello",
    "max_tokens": 16,
    "slo": {"e2e_ms": 5000},
}


def _without(key: str) -> dict[str, Any]:
    return {k: v for k, v in GOOD.items() if k != key}


BAD: dict[str, dict[str, Any]] = {
    "missing model": _without("model"),
    "missing request_id": _without("request_id"),
    "missing max_tokens": _without("max_tokens"),
    "missing slo": _without("slo"),
    "empty model": {**GOOD, "model": ""},
    "max_tokens 0": {**GOOD, "max_tokens": 0},
    "max_tokens negative": {**GOOD, "max_tokens": -3},
    "max_tokens fractional": {**GOOD, "max_tokens": 1.5},
    "prompt and messages": {**GOOD, "messages": [{"role": "user", "content": "hi"}]},
    "prompt and token ids": {**GOOD, "prompt_token_ids": [1, 2, 3]},
    "all three prompts": {
        **GOOD,
        "messages": [{"role": "user", "content": "hi"}],
        "prompt_token_ids": [1],
    },
    "no prompt": _without("prompt"),
    "only null prompt": {**GOOD, "prompt": None},
    "empty messages": {**_without("prompt"), "messages": []},
    "empty token ids": {**_without("prompt"), "prompt_token_ids": []},
    "negative token id": {**_without("prompt"), "prompt_token_ids": [5, -1]},
    "no slo deadline": {**GOOD, "slo": {}},
    "null slo deadlines": {**GOOD, "slo": {"e2e_ms": None, "ttft_ms": None, "slo_class": "x"}},
    "zero deadline": {**GOOD, "slo": {"e2e_ms": 0}},
    "task without an id": {**GOOD, "task": {"task_slo_ms": 1000}},
    "negative remaining time": {**GOOD, "task": {"task_id": "t", "remaining_ms": -1}},
    "task started at 0": {**GOOD, "task": {"task_id": "t", "task_started_at": 0}},
    "model is a number": {**GOOD, "model": 7},
    "prompt is a list": {**GOOD, "prompt": ["Hello"]},
    "max_tokens is a word": {**GOOD, "max_tokens": "many"},
    "slo is a string": {**GOOD, "slo": "fast"},
    "messages is a string": {**_without("prompt"), "messages": "hi"},
    "bad role": {**_without("prompt"), "messages": [{"role": "robot", "content": "hi"}]},
    "token id is a word": {**_without("prompt"), "prompt_token_ids": ["one"]},
    "priority 10": {**GOOD, "priority": 10},
    "temperature 3": {**GOOD, "sampling": {"temperature": 3.0}},
    "top_p 0": {**GOOD, "sampling": {"top_p": 0}},
    "17 stop strings": {**GOOD, "sampling": {"stop": ["x"] * 17}},
    "version 2": {**GOOD, "version": 2},
    "request_id with a space": {**GOOD, "request_id": "req 1"},
    "request_id with a trailing newline": {**GOOD, "request_id": "req-1\n"},
    "request_id too long": {**GOOD, "request_id": "r" * 129},
    "extra top-level field": {**GOOD, "n": 2},
    "extra slo field": {**GOOD, "slo": {"e2e_ms": 5000, "tpot_ms": 50}},
    "extra sampling field": {**GOOD, "sampling": {"beam_width": 4}},
    "extra message field": {
        **_without("prompt"),
        "messages": [{"role": "user", "content": "hi", "name": "bob"}],
    },
    "not an object": ["req-1"],  # type: ignore[dict-item]
}


def test_the_good_example_passes_both() -> None:
    assert schema_accepts(GOOD)
    assert pydantic_accepts(json.dumps(GOOD).encode())


def test_a_ttft_deadline_after_the_e2e_deadline_is_refused() -> None:
    # JSON Schema cannot compare two fields: producers' validators let it through, the
    # coordinator's refuses it (schema_violation), as docs/protocol.md says
    doc = {**GOOD, "slo": {"e2e_ms": 1000, "ttft_ms": 2000}}
    with pytest.raises(PydanticValidationError, match="ttft_ms is longer"):
        RequestMessage.model_validate(doc)
    RequestMessage.model_validate({**GOOD, "slo": {"e2e_ms": 2000, "ttft_ms": 2000}})


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_request_fails_both_validators(name: str) -> None:
    doc = BAD[name]
    assert not schema_accepts(doc), f"JSON Schema accepts {name}"
    assert not pydantic_accepts(json.dumps(doc).encode()), f"pydantic accepts {name}"


def test_replies_validate_against_their_definitions() -> None:
    result = ResultMessage(
        request_id="req-1",
        model="mistral-7b",
        output_text="Hello!",
        output_token_ids=[15043, 29991],
        finish_reason="stop",
        usage=Usage(prompt_tokens=2, completion_tokens=2),
        timestamps=Timestamps(
            submitted=1.0, queued=1.1, started=1.2, first_token=1.3, finished=1.4
        ),
        slo=SLOOutcome(met=True, e2e_met=True, e2e_ms=400.0),
        instance_id="a100-0-gpu0",
        attempts=1,
    )
    result_schema = _validator("ResultMessage")
    result_schema.validate(json.loads(result.model_dump_json()))
    assert not result_schema.is_valid({**result.model_dump(mode="json"), "attempts": 0})
    err = ErrorMessage(request_id=None, code=ErrorCode.INVALID_JSON, message="not JSON")
    _validator("ErrorMessage").validate(json.loads(err.model_dump_json()))
    assert not _validator("ErrorMessage").is_valid({**err.model_dump(mode="json"), "code": "x"})


token_runs = st.fixed_dictionaries(
    {
        "request_id": texts(1, 40),
        "offset": st.integers(0, 10**6),
        "token_ids": st.lists(st.integers(0, MAX_TOKEN_ID), max_size=8),
        "text": texts(),
        "attempt": st.none() | st.integers(1, 50),
    }
)
batched_chunks = st.builds(
    lambda run, cid: BatchedChunk(correlation_id=cid, **run),
    token_runs,
    st.none() | texts(1, 40),
)


def _top_level_matches(doc: Any) -> list[str]:
    """The top-level definitions (the schema's ``oneOf``) that accept ``doc``."""
    names = ["RequestMessage", "CancelMessage", "ResultMessage", "ErrorMessage"]
    return [n for n in [*names, "TokenChunk", "TokenBatch"] if _validator(n).is_valid(doc)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_runs, st.lists(batched_chunks, min_size=1, max_size=5))
def test_token_messages_validate_against_their_definitions(
    run: dict[str, Any], chunks: list[BatchedChunk]
) -> None:
    # what agents send: both shapes conform, and each is exactly one top-level message kind
    single = json.loads(TokenChunk(**run).model_dump_json())
    batch = json.loads(TokenBatch(chunks=chunks).model_dump_json())
    assert _top_level_matches(single) == ["TokenChunk"]
    assert _top_level_matches(batch) == ["TokenBatch"]


def test_the_schema_refuses_malformed_token_batches() -> None:
    batch = _validator("TokenBatch")
    chunk = {"correlation_id": "c", "request_id": "r", "offset": 0, "token_ids": [1]}
    assert batch.is_valid({"type": "tokens_batch", "chunks": [chunk]})
    for bad in (
        {"type": "tokens_batch", "chunks": []},  # nothing in it
        {"type": "tokens", "chunks": [chunk]},  # the single chunk's type
        {"type": "tokens_batch", "chunks": [{**chunk, "correlation_id": ""}]},
        {
            "type": "tokens_batch",
            "chunks": [{k: v for k, v in chunk.items() if k != "correlation_id"}],
        },
        {"type": "tokens_batch", "chunks": [{**chunk, "offset": -1}]},
        {"type": "tokens_batch", "chunks": [chunk], "correlation_id": "c"},
    ):
        assert not batch.is_valid(bad), bad
        with pytest.raises(PydanticValidationError):
            TokenBatch.model_validate(bad)


def test_the_json_examples_in_docs_protocol_md_are_valid() -> None:
    doc = Path(qlm.__file__).parents[1] / "docs" / "protocol.md"
    blocks = re.findall(r"```json\n(.*?)```", doc.read_text(), flags=re.DOTALL)
    kinds: Counter[str] = Counter()
    for block in blocks:
        message = json.loads(block)
        kind = {
            "result": "ResultMessage",
            "error": "ErrorMessage",
            "cancel": "CancelMessage",
            "tokens": "TokenChunk",
            "tokens_batch": "TokenBatch",
        }.get(message.get("type"), "RequestMessage")
        _validator(kind).validate(message)
        kinds[kind] += 1
    assert kinds == {
        "RequestMessage": 2,
        "ResultMessage": 1,
        "ErrorMessage": 1,
        "CancelMessage": 1,
        "TokenChunk": 1,
        "TokenBatch": 1,
    }
