"""Control frames and chunk tails: what a receiver checks before and after a receive."""

import pytest
import torch

from lm_resiliency import wire
from lm_resiliency.gemini.replication import chunk_tails, message_tag


def test_frame_round_trip_and_truncation():
    payload = torch.tensor([7, 8, 9], dtype=torch.uint8)
    assert wire.read_frame(wire.frame(payload), 3, limit=3) == (3, 9)
    truncated = wire.frame(payload)
    truncated.view(torch.uint8)[20:] = 0  # the last four bytes never arrived
    with pytest.raises(wire.ShortMessage, match="control frame from rank 3 arrived truncated"):
        wire.read_frame(truncated, 3, limit=3)
    with pytest.raises(wire.ShortMessage, match="rank 3 announced a 3-byte message; at most 2 bytes"):
        wire.read_frame(wire.frame(payload), 3, limit=2)


@pytest.mark.parametrize("total, chunk", [(0, 4), (1, 4), (4, 4), (5, 4), (9, 4), (3, 512)])
def test_chunk_tails_are_the_final_byte_of_each_chunk(total, chunk):
    payload = torch.arange(total, dtype=torch.uint8) + 100
    ends = [min((i + 1) * chunk, total) - 1 for i in range(-(-total // chunk))]
    assert chunk_tails(payload, chunk) == bytes(payload[ends].tolist()).hex()


def test_message_tags_never_collide_and_fit_int32():
    span = 1 << 30
    exchange = {message_tag(n) for n in (0, 1, span - 1)}
    recovery = {message_tag(n, recovery=True) for n in (0, 1, span - 2)}
    assert exchange == {1, 2, span} and min(recovery) == span + 1 and max(recovery) == 2 ** 31 - 1
    assert message_tag(span) == message_tag(0)
