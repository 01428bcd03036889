"""Binary hidden-state frames: what goes in comes out; anything malformed is refused by name."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from libs.contracts import ContractError, Frame, FrameKind, decode_frame
from libs.contracts.frames import MAX_FRAME_BYTES


def hidden(rows: int, width: int = 576) -> Frame:
    data = np.arange(rows * width, dtype=np.float32).tobytes()
    return Frame(
        FrameKind.PREFILL,
        "req-1",
        epoch=3,
        position=17,
        flags=1,
        meta=b'{"a":1}',
        dtype="float32",
        shape=(rows, width),
        data=data,
    )


def test_a_frame_round_trips_exactly() -> None:
    frame = hidden(5)
    back = decode_frame(frame.encode())
    assert back == frame and back.final
    values = np.frombuffer(back.data, dtype=np.float32).reshape(back.shape)
    assert values[4, 575] == 5 * 576 - 1
    token = Frame(FrameKind.TOKEN, "r", epoch=1, position=9, token=49151)
    assert decode_frame(token.encode()) == token


def test_a_prompt_chunk_fits_and_an_oversized_frame_is_refused() -> None:
    assert len(hidden(256).encode()) < MAX_FRAME_BYTES
    with pytest.raises(ContractError) as err:
        hidden(600).encode()
    assert err.value.reason == "too_large"


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda raw: b"XXXX" + raw[4:], "magic"),
        (lambda raw: raw[:-4], "lengths"),
        (lambda raw: raw + b"\0", "lengths"),
        (lambda raw: raw[:4] + bytes([9]) + raw[5:], "kind"),
        (lambda raw: raw[:6] + bytes([77]) + raw[7:], "dtype"),
        (lambda raw: raw[:10], "shorter"),
    ],
)
def test_malformed_frames_are_refused_with_a_reason(mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ContractError) as err:
        decode_frame(mutate(hidden(2).encode()))
    assert err.value.reason == "malformed_frame" and needle in err.value.detail


def test_a_shape_that_disagrees_with_the_data_is_refused() -> None:
    raw = bytearray(hidden(2).encode())
    head = struct.calcsize("<4sBBBBIIIIIH")
    struct.pack_into("<I", raw, head + len(b"req-1"), 3)  # rows 2 -> 3
    with pytest.raises(ContractError, match="shape"):
        decode_frame(bytes(raw))


def test_a_request_id_that_is_not_a_subject_token_is_refused() -> None:
    with pytest.raises(ContractError, match="request_id"):
        decode_frame(Frame(FrameKind.END, "bad id.*", epoch=1).encode())
