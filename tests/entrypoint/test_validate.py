"""``Generate``'s step 1 (validate) on image spans, in process with fake workers (the helpers of
``test_service``): each refusal is INVALID_ARGUMENT before any hop, with the precise reason, the
same one ``kvstore.keys`` gives for the same spans (the entrypoint checks them with its code)."""

from __future__ import annotations

import grpc
import pytest

from entrypoint.proto import serving_pb2 as pb
from entrypoint.proto import serving_pb2_grpc as pbg
from kvstore.errors import InvalidRequest
from kvstore.keys import ImageSpan, check_image_spans
from tests.entrypoint.test_service import stack  # noqa: F401 - fixture


def _refusal(stack, images: list[pb.ImageSegment], n_tokens: int = 10) -> str:
    svc, ch, fakes, _ = stack()
    for role, (fake, address) in fakes.items():
        svc.registry.add(fake.worker_id, role, address)
    req = pb.GenerateRequest(token_ids=list(range(1, n_tokens + 1)), images=images,
                             sampling=pb.Sampling(max_new_tokens=2))
    events = []
    with pytest.raises(grpc.RpcError) as ei:
        for ev in pbg.EntrypointStub(ch).Generate(req, timeout=30):
            events.append(ev)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
    assert events == [] and fakes["prefill"][0].prefills == []  # before any hop
    return ei.value.details()


def _keys_says(spans: list[tuple[bytes, int, int]], n_tokens: int = 10) -> str:
    with pytest.raises(InvalidRequest) as ei:
        check_image_spans([ImageSpan(*sp) for sp in spans], n_tokens)
    return str(ei.value)


def test_a_span_outside_the_prompt_is_refused_with_the_reason_kvstore_keys_gives(stack):
    """Before: "image span [8, 13) is empty, has no hash, or lies outside the 10-token prompt"
    (three reasons for one; the check was a hand copy of ``check_image_spans``)."""
    details = _refusal(stack, [pb.ImageSegment(image_hash=b"h", start=8, length=5)])
    assert details == _keys_says([(b"h", 8, 5)])
    assert "outside the 10-token prompt" in details and "has no hash" not in details


def test_overlapping_spans_are_refused_with_the_reason_kvstore_keys_gives(stack):
    details = _refusal(stack, [pb.ImageSegment(image_hash=b"b", start=4, length=3),
                               pb.ImageSegment(image_hash=b"a", start=1, length=4)])
    assert details == _keys_says([(b"b", 4, 3), (b"a", 1, 4)]) and "overlap" in details


@pytest.mark.parametrize("segment, reason", [
    (pb.ImageSegment(image_hash=b"", start=1, length=2), "image_hash must be non-empty"),
    (pb.ImageSegment(image_hash=b"h", start=1, length=0), "length > 0"),
])
def test_a_span_without_a_hash_or_a_length_is_refused_saying_which(stack, segment, reason):
    """Before: one message for both ("is empty, has no hash, or lies outside ...")."""
    details = _refusal(stack, [segment])
    assert reason in details and "outside" not in details
