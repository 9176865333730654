"""The TCP connector's framing over a socketpair, and block gather/scatter of the KV layouts."""

import socket
import struct
import time
import zlib

import msgspec
import pytest
import torch
from torch import nn

from widellm.kv_transfer import kv_layout, wire
from widellm.kv_transfer.stats import TransferError
from widellm.layers.attention import Attention


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def receiver(sock, timeout_s: float = 2.0) -> wire.Receiver:
    return wire.Receiver(sock, time.monotonic() + timeout_s)


# ---- wire ---------------------------------------------------------------------------------


def test_message_round_trip(pair):
    a, b = pair
    msg = {"op": "pull", "engine_id": "e-dp0", "request_id": "r", "block_ids": [3, 5, 900]}
    wire.send_message(a, msg)
    wire.send_message(a, {"ok": True})
    r = receiver(b)
    assert r.message() == msg
    assert r.message() == {"ok": True}


def test_frame_into_receives_the_exact_bytes(pair):
    a, b = pair
    payload = bytes(range(256)) * 3
    view = memoryview(payload)
    wire.send_frame(a, view, wire.crc32(view))
    out = bytearray(len(payload))
    receiver(b).frame_into(memoryview(out))
    assert bytes(out) == payload
    # The header on the wire: 8-byte length, 4-byte crc32, big-endian.
    wire.send_frame(a, memoryview(b"xyz"), wire.crc32(memoryview(b"xyz")))
    head = b.recv(12)
    assert head == struct.pack("!QI", 3, zlib.crc32(b"xyz") & 0xFFFFFFFF)
    assert b.recv(3) == b"xyz"


def test_wrong_crc_is_a_checksum_error(pair):
    a, b = pair
    view = memoryview(b"some kv bytes")
    wire.send_frame(a, view, (wire.crc32(view) + 1) & 0xFFFFFFFF)
    with pytest.raises(TransferError) as e:
        receiver(b).frame_into(memoryview(bytearray(len(view))))
    assert e.value.cause == "checksum"


def test_peer_closing_mid_frame_is_a_short_payload(pair):
    a, b = pair
    view = memoryview(bytes(100))
    wire.send_partial_frame(a, view, wire.crc32(view))
    a.close()
    with pytest.raises(TransferError) as e:
        receiver(b).frame_into(memoryview(bytearray(100)))
    assert e.value.cause == "short_payload"
    assert "after 50 of 100 bytes" in str(e.value)


def test_nothing_before_the_deadline_is_a_timeout(pair):
    _, b = pair
    start = time.monotonic()
    with pytest.raises(TransferError) as e:
        receiver(b, timeout_s=0.2).message()
    assert e.value.cause == "timeout"
    assert 0.15 < time.monotonic() - start < 2.0


def test_a_deadline_already_past_is_a_timeout(pair):
    a, b = pair
    wire.send_message(a, {"ok": True})
    with pytest.raises(TransferError) as e:
        wire.Receiver(b, time.monotonic() - 1).message()
    assert e.value.cause == "timeout"


def test_frame_of_the_wrong_length_is_a_layout_error(pair):
    a, b = pair
    view = memoryview(bytes(64))
    wire.send_frame(a, view, wire.crc32(view))
    with pytest.raises(TransferError) as e:
        receiver(b).frame_into(memoryview(bytearray(32)))
    assert e.value.cause == "layout"
    assert "64-byte layer where 32 were due" in str(e.value)


def test_an_oversized_or_non_map_header_is_a_layout_error(pair):
    a, b = pair
    a.sendall(struct.pack("!I", wire.MAX_MESSAGE_BYTES + 1))
    with pytest.raises(TransferError) as e:
        receiver(b).message()
    assert e.value.cause == "layout"
    data = msgspec.msgpack.encode([1, 2])
    a.sendall(struct.pack("!I", len(data)) + data)
    with pytest.raises(TransferError) as e:
        receiver(b).message()
    assert e.value.cause == "layout"


def test_an_undecodable_header_is_a_checksum_error(pair):
    a, b = pair
    a.sendall(struct.pack("!I", 1) + b"\xc1")  # 0xc1 is never used in msgpack
    with pytest.raises(TransferError) as e:
        receiver(b).message()
    assert e.value.cause == "checksum"


# ---- kv_layout ----------------------------------------------------------------------------


class FakeMLA(nn.Module):
    def __init__(self, latent: int) -> None:
        super().__init__()
        self.latent = latent

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.latent)


class NoBlockDim(nn.Module):
    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (4, block_size)


def test_block_dim_of_mha_and_mla():
    assert kv_layout.block_dim_of(Attention(4, 8, 2, 0.125), 16) == 1
    assert kv_layout.block_dim_of(FakeMLA(576), 16) == 0
    with pytest.raises(ValueError, match="cannot tell the block dim of NoBlockDim"):
        kv_layout.block_dim_of(NoBlockDim(), 16)


def test_describe_and_layer_nbytes():
    mha = torch.zeros(2, 10, 4, 3, 8, dtype=torch.float32)
    mla = torch.zeros(10, 4, 12, dtype=torch.bfloat16)
    assert kv_layout.describe([mha, mla], [1, 0]) == [
        [[2, 1, 4, 3, 8], "float32"], [[1, 4, 12], "bfloat16"]]
    assert kv_layout.layer_nbytes(mha, 1, 3) == 3 * 2 * 4 * 3 * 8 * 4
    assert kv_layout.layer_nbytes(mla, 0, 2) == 2 * 4 * 12 * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,dim", [((2, 8, 4, 2, 3), 1), ((8, 4, 6), 0)],
                         ids=["mha", "mla"])
def test_gather_then_scatter_moves_exactly_those_blocks(dtype, shape, dim):
    g = torch.Generator().manual_seed(0)
    src = torch.randn(shape, generator=g).to(dtype)
    dst = torch.randn(shape, generator=g).to(dtype)
    before = dst.clone()
    src_ids, dst_ids = [6, 1, 3], [0, 4, 7]
    data = kv_layout.gather_blocks(src, dim, torch.tensor(src_ids))
    assert data.dtype == torch.uint8
    assert data.numel() == kv_layout.layer_nbytes(src, dim, 3)
    kv_layout.scatter_blocks(dst, dim, torch.tensor(dst_ids), data)
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(dst.select(dim, d), src.select(dim, s))
    for other in set(range(8)) - set(dst_ids):
        assert torch.equal(dst.select(dim, other), before.select(dim, other))
