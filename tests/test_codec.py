"""The wire protocol: header, indices, every value format and the payload round-trip exactly and are checked."""

import dataclasses
import math
import re

import pytest
import torch

from codec_helpers import decode_params, decode_values, encode_params, encode_values
from hf_demo import compression as F
from hf_demo.compression import plan
from hf_demo.errors import DeMoPayloadError, DeMoSyncError
from hf_demo.wire import codec


def _header(**kw):
    base = dict(
        step=12345,
        layout_checksum=0xDEADBEEF,
        settings_checksum=7,
        flags=codec.FLAG_NONFINITE,
        world_size=4,
        payload_bytes=1 << 40,
        payload_crc=0xFFFFFFFF,
        fingerprint=(1 << 62) - 1,
    )
    return codec.Header(**{**base, **kw})


def test_header_round_trip():
    h = _header(tag=bytes(range(32)))
    b = h.to_bytes()
    assert b.dtype == torch.uint8 and b.numel() == codec.HEADER_BYTES
    assert codec.Header.from_bytes(b) == h


def test_indices_round_trip_full_16_bit_range(device):
    idx = torch.tensor([[0, 1, 32767, 32768], [65535, 4095, 12, 40000]], device=device)
    u16 = codec.index_coding("uint16")
    wire = u16.pack_rows(idx, 65536, 4).reshape(-1)
    assert wire.dtype == torch.uint8 and wire.numel() == 16 and wire.device == device
    assert torch.equal(wire.cpu(), u16.pack_rows(idx.cpu(), 65536, 4).reshape(-1))
    back = u16.unpack_rows(torch.stack([wire, wire]), 2, 65536, 4)
    assert torch.equal(back[0], idx) and torch.equal(back[1], idx)


@pytest.mark.parametrize("fmt", codec.VALUE_FORMATS)
@pytest.mark.parametrize("nblocks,k", [(1, 1), (3, 5), (17, 32)])
def test_values_round_trip_exactly(fmt, nblocks, k, device):
    torch.manual_seed(nblocks * k)
    values = torch.randn(nblocks, k).to(device)
    sent, wire = encode_values(fmt, values)
    assert wire.numel() == codec.value_format(fmt).nbytes(nblocks, k) and wire.device == sent.device == device
    assert torch.equal(wire.cpu(), encode_values(fmt, values.cpu())[1])  # the same bytes from every device
    decoded = decode_values(fmt, torch.stack([wire, wire]), nblocks, k)
    assert torch.equal(decoded[0], sent) and torch.equal(decoded[1], sent)


def test_value_formats_mean_what_they_say():
    values = torch.tensor([[0.3, -1.7, 2.0, -0.5]])
    assert torch.equal(encode_values("fp32", values)[0], values)
    assert torch.equal(encode_values("bf16", values)[0], values.to(torch.bfloat16).float())
    sent, wire = encode_values("sign", values)
    scale = torch.tensor(1.125).to(torch.bfloat16).float()  # mean |v|
    assert torch.equal(sent, scale * torch.tensor([[1.0, -1.0, 1.0, -1.0]]))
    assert wire.numel() == 8  # 2-byte scale + 1 byte of bits, each 4-aligned


def test_two_bit_values_are_a_sign_and_the_mean_magnitude_of_their_class():
    values = torch.tensor([[0.3, -1.7, 2.0, -0.5]])  # mean |v| 1.125: 1.7 and 2.0 large, 0.3 and 0.5 small
    sent, wire = encode_values("2bit", values)
    small, large = (torch.tensor(x).to(torch.bfloat16) for x in (0.4, 1.85))  # each class's mean magnitude
    assert torch.equal(sent, torch.stack([small, -large, large, -small]).float()[None])
    scales = torch.stack([small, large]).view(torch.uint8)
    # 2 bf16 magnitudes (4 bytes), then the sign bits (0b1010) and the class bits (0b0110), each 4-aligned
    assert wire.tolist() == [*scales.tolist(), 0b1010, 0, 0, 0, 0b0110, 0, 0, 0]


@pytest.mark.parametrize(
    "values,expected",
    [
        ([[1.0, -1.0, 1.0]], [[1.0, -1.0, 1.0]]),  # every magnitude equal: all large, no small class (0)
        ([[0.0, 0.0]], [[0.0, 0.0]]),
        ([[-3.0]], [[-3.0]]),  # k = 1
        ([[4.0, 1.0, 1.0, 1.0, -1.0]], [[4.0, 1.0, 1.0, 1.0, -1.0]]),  # mean 1.6: one large
    ],
)
def test_two_bit_edge_cases(values, expected):
    sent, wire = encode_values("2bit", torch.tensor(values))
    assert torch.equal(sent, torch.tensor(expected))
    assert torch.equal(decode_values("2bit", wire[None], *sent.shape)[0], sent)


def test_two_bit_loses_less_than_sign_and_its_error_stays_in_the_momentum():
    torch.manual_seed(0)
    layout = plan((256, 256), 64, 32)
    momentum = torch.randn(layout.nblocks, layout.bsize) ** 3  # heavy tails, as DCT momenta have
    idx, values = F.select(momentum.clone(), layout.k)
    errors = {}
    for fmt in ("sign", "2bit"):
        sent, _ = encode_values(fmt, values)
        errors[fmt] = float(((values - sent) ** 2).sum())
        residual = momentum.clone()
        F.feedback(residual, idx, sent)
        torch.testing.assert_close(residual.gather(1, idx), values - sent, atol=1e-6, rtol=0)  # the loss kept
    assert errors["2bit"] < 0.6 * errors["sign"], errors


def test_two_bit_magnitudes_no_encoder_writes_are_refused():
    pc, _, payload, _ = _payload("2bit")
    off = codec.index_bytes(pc.layouts[0], "uint16")
    for small, large in [(2.0, 1.0), (-1.0, 1.0)]:  # out of order; negative
        bad = payload.clone()
        bad[off : off + 4] = torch.tensor([small, large]).to(torch.bfloat16).view(torch.uint8)
        with pytest.raises(DeMoSyncError, match=r"NaN/Inf coefficients for parameter 0 .* rank\(s\) \[1\]"):
            decode_params(pc, torch.stack([payload, bad]))


def test_wire_cost_per_coefficient():
    layout = plan((576, 576), 64, 32)
    per_param = {f: codec.segment_bytes(layout, f, "uint16") / layout.numel for f in codec.VALUE_FORMATS}
    assert per_param["bf16"] == pytest.approx(4 * 32 / 4096)
    assert per_param["fp32"] == pytest.approx(6 * 32 / 4096)
    assert per_param["sign"] <= 0.02
    # 81 blocks x 32: 16-bit positions, two bf16 magnitudes per block, 2592 sign and 2592 class bits
    assert codec.segment_bytes(layout, "2bit", "uint16") == 81 * 32 * 2 + 81 * 4 + 324 + 324
    assert codec.segment_bytes(layout, "2bit", "elias_fano") == 81 * 36 + 81 * 4 + 324 + 324  # 0.0095 B/param
    assert codec.value_format("2bit").nbytes(3, 5) == 12 + 4 + 4  # each stream 4-aligned


def test_unknown_format():
    with pytest.raises(ValueError, match="value format"):
        codec.value_format("int4")


def _payload(fmt="bf16", device="cpu", coding="uint16"):
    torch.manual_seed(0)
    layouts = [plan((70, 10), 8, 5), plan((13,), 8, 3), plan((16, 8), 8, 5)]
    pc = codec.PayloadCodec(layouts, fmt, coding)
    selections = [  # positions sorted in each block, as DeMo's select returns them
        (
            torch.randn(lay.nblocks, lay.bsize).abs().topk(lay.k, 1).indices.sort(1).values,
            torch.randn(lay.nblocks, lay.k),
        )
        for lay in layouts
    ]
    selections = [(idx.to(device), values.to(device)) for idx, values in selections]
    payload, sent = encode_params(pc, selections, device)
    return pc, selections, payload, sent


@pytest.mark.parametrize("coding", codec.INDEX_CODINGS)
@pytest.mark.parametrize("fmt", codec.VALUE_FORMATS)
def test_payload_round_trip(fmt, coding, device):
    pc, selections, payload, sent = _payload(fmt, device, coding)
    assert payload.numel() == pc.nbytes and payload.device == device
    assert torch.equal(payload.cpu(), _payload(fmt, coding=coding)[2])  # the same bytes from every device
    rows = torch.stack([payload, payload])
    headers = [codec.sign(_header(), payload, b"k")] * 2
    assert headers[0].payload_crc == codec.crc32(payload.cpu())
    codec.verify_rows(headers, rows, b"k", rank=0, step=0)  # CRC32 and HMAC of device rows, on the host
    decoded = decode_params(pc, rows)
    for (idx, _), values, (d_idx, d_values) in zip(selections, sent, decoded):
        assert d_idx.device == d_values.device == device
        assert torch.equal(d_idx[1], idx) and torch.equal(d_values[1], values)


def test_payload_decode_names_out_of_range_indices_and_nan_values():
    pc, _, payload, _ = _payload("fp32")
    bad = payload.clone()
    bad[:2] = 255  # first index of the first block: 65535 >= 64
    with pytest.raises(DeMoSyncError, match=r"out-of-range indices for parameter 0 .* rank\(s\) \[1\]"):
        decode_params(pc, torch.stack([payload, bad]))
    bad = payload.clone()
    off = codec.index_bytes(pc.layouts[0], "uint16")
    bad[off : off + 4] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)  # fp32 NaN
    with pytest.raises(DeMoSyncError, match=r"NaN/Inf coefficients for parameter 0 .* rank\(s\) \[0\]"):
        decode_params(pc, torch.stack([bad, payload]))


def test_payload_decode_refuses_repeated_uint16_positions_before_a_count_can_wrap():
    """256 copies of one position wrapped the uint8 picker count to 0 (an Inf coefficient past the NaN check)."""
    layout = plan((64, 64), 64, 256)
    pc = codec.PayloadCodec([layout], "fp32", "uint16")
    idx, values = torch.full((1, 256), 5, dtype=torch.int64), torch.ones(1, 256)
    payload = encode_params(pc, [(idx, values)], "cpu")[0]
    good = encode_params(pc, [(torch.arange(256)[None], values)], "cpu")[0]
    with pytest.raises(DeMoPayloadError, match=r"repeated positions .* parameter 0 .* rank\(s\) \[1\]"):
        decode_params(pc, torch.stack([good, payload]))


@pytest.mark.parametrize(
    "shape,chunk,k",
    [
        ((256, 256), 64, 32),  # 64x64 blocks, the default
        ((688, 256), 64, 32),  # 43x64 blocks
        ((300,), 64, 32),  # a vector: blocks of 60, k close to the block size
        ((7,), 64, 32),  # one block smaller than k: every position sent
        ((256, 256), 64, 4),
        ((256, 256), 64, 1),
        ((128, 128), 64, 4096),  # k = the block size
        ((1000, 1000), 128, 64),  # padded 128x128 blocks
    ],
)
def test_elias_fano_round_trips_sorted_positions_in_about_log2_of_block_over_k_plus_2_bits(shape, chunk, k, device):
    torch.manual_seed(k)
    ef = codec.index_coding("elias_fano")
    layouts = [plan(shape, chunk, k), plan((5, 9), 8, 3), plan(shape, chunk, k)]  # two share a (size, k) group
    idxs = [
        torch.randn(lay.nblocks, lay.bsize).abs().topk(lay.k, 1).indices.sort(1).values.to(device) for lay in layouts
    ]
    back = []
    for idx, lay in zip(idxs, layouts):
        r = ef.pack_rows(idx, lay.bsize, lay.k)
        assert (
            r.dtype == torch.uint8
            and r.device == device
            and r.shape == (lay.nblocks, ef.record_bytes(lay.bsize, lay.k))
        )
        assert r.numel() <= ef.nbytes(lay) < r.numel() + 4  # the payload's segment: the records, 4-aligned
        assert torch.equal(r.cpu(), ef.pack_rows(idx.cpu(), lay.bsize, lay.k))  # the same bytes from every device
        back.append(ef.unpack_rows(torch.stack([r, r]).flatten(1), lay.nblocks, lay.bsize, lay.k))
    assert all(torch.equal(b[0], i) and torch.equal(b[1], i) for b, i in zip(back, idxs))
    pc = codec.PayloadCodec(layouts, "fp32", "elias_fano")  # two layouts of one (size, k) bucket: coded at once
    payload, _ = encode_params(pc, [(i, torch.ones(i.shape, device=device)) for i in idxs], device)
    assert all(torch.equal(d[1], i) for (d, _), i in zip(decode_params(pc, torch.stack([payload, payload])), idxs))
    lay = layouts[0]
    bits = ef.nbytes(lay) * 8 / (lay.nblocks * lay.k)
    # Elias-Fano's 2 + ceil(log2(n/k)), plus each record rounded to whole bytes and the segment to 4 bytes
    assert bits <= math.ceil(math.log2(lay.bsize / lay.k)) + 2 + 8 / lay.k + 32 / (lay.nblocks * lay.k), bits
    assert ef.nbytes(lay) <= codec.index_bytes(lay, "uint16")


def test_elias_fano_wire_cost_per_coefficient():
    layout = plan((576, 576), 64, 32)
    assert codec.index_bytes(layout, "elias_fano") * 8 == layout.nblocks * 32 * 9  # 9 bits, not 16
    assert codec.segment_bytes(layout, "bf16", "elias_fano") / layout.numel == pytest.approx(25 * 32 / 8 / 4096)
    assert codec.segment_bytes(layout, "sign", "elias_fano") / layout.numel <= 0.0105
    assert (
        codec.index_bytes(plan((576, 576), 64, 4), "elias_fano") == 488
    )  # 81 blocks x 6 bytes (12 bits each), 4-aligned


@pytest.mark.parametrize("flaw", ["no position in the upper vector", "a repeated position"])
def test_elias_fano_names_a_corrupted_record(flaw):
    pc, selections, payload, _ = _payload("bf16", coding="elias_fano")
    low, upper = codec.EliasFanoIndices.split(pc.layouts[0].bsize, pc.layouts[0].k)
    if flaw == "no position in the upper vector":  # clear the first block's upper vector
        bad = payload.clone()
        bits = codec.byte_bits(bad[None, :16])[0, :128].bool()
        bits[5 * low : 5 * low + upper] = False
        bad[:16] = codec.pack_bits(bits)
    else:  # a record that passes the count of ones, but whose positions do not strictly increase
        idx, values = selections[0]
        idx = idx.clone()
        idx[0, 1] = idx[0, 0]
        bad = encode_params(pc, [(idx, values), *selections[1:]], "cpu")[0]
    with pytest.raises(DeMoSyncError, match=r"out-of-range indices for parameter 0 .* rank\(s\) \[1\]"):
        decode_params(pc, torch.stack([payload, bad]))


def test_crc_catches_every_single_flipped_byte():
    _, _, payload, _ = _payload("sign")
    headers = [codec.sign(_header(), payload, None)] * 2
    for pos in range(0, payload.numel(), 7):
        bad = payload.clone()
        bad[pos] ^= 0x10
        with pytest.raises(DeMoSyncError, match="from rank 1 .* CRC32"):
            codec.verify_rows(headers, torch.stack([payload, bad]), None, rank=0, step=3)


def test_hmac_refuses_a_payload_signed_with_another_secret_or_unsigned():
    _, _, payload, _ = _payload()
    good = codec.sign(_header(), payload, b"s3cret")
    codec.verify_rows([good], payload[None], b"s3cret", rank=0, step=0)
    forged = codec.sign(_header(), payload, b"other")
    with pytest.raises(DeMoSyncError, match="HMAC"):
        codec.verify_rows([forged], payload[None], b"s3cret", rank=0, step=0)
    unsigned = codec.sign(_header(), payload, None)
    with pytest.raises(DeMoSyncError, match="HMAC"):
        codec.verify_rows([unsigned], payload[None], b"s3cret", rank=0, step=0)
    # a tag alone does not pass a changed header either (the step is covered)
    replayed = dataclasses.replace(good, step=good.step + 1)
    with pytest.raises(DeMoSyncError, match="HMAC"):
        codec.verify_rows([replayed], payload[None], b"s3cret", rank=0, step=0)


def test_check_headers_names_every_disagreement():
    ref = _header(flags=0)
    with pytest.raises(DeMoSyncError, match="rank 1 is at optimizer step 12346"):
        codec.check_headers([ref, dataclasses.replace(ref, step=12346)], 0)
    with pytest.raises(DeMoSyncError, match="different optimizer settings"):
        codec.check_headers([ref, dataclasses.replace(ref, settings_checksum=8)], 0)
    with pytest.raises(DeMoSyncError, match="HF_DEMO_SECRET"):
        codec.check_headers([ref, dataclasses.replace(ref, flags=codec.FLAG_AUTH)], 0)
    codec.check_headers([ref, dataclasses.replace(ref, flags=codec.FLAG_NONFINITE)], 0)  # flags may differ
    older = f"rank 1 speaks wire format {codec.MAGIC:#x}/v{codec.FORMAT_VERSION - 1}, expected "
    with pytest.raises(DeMoSyncError, match=re.escape(older) + r".*\(different hf_demo versions\?\)"):
        codec.check_headers([ref, dataclasses.replace(ref, version=codec.FORMAT_VERSION - 1)], 0)


def test_format_2_and_3_headers_still_parse():
    """Optimizer states of formats 2 and 3 may hold the 12- and 13-word headers of an in-flight overlap exchange."""
    h = codec.Header(step=3, layout_checksum=1, settings_checksum=2, flags=4, world_size=2, payload_bytes=10,
                     payload_crc=9, fingerprint=7, exchange_ms=5, elapsed_ms=6, grad_fingerprint=11)  # fmt: skip
    raw = h.to_bytes()
    v2 = torch.cat([raw[: 12 * 8], raw[14 * 8 :]])  # without the 13th word (grad_fingerprint) and the CRC32
    v3 = torch.cat([raw[: 13 * 8], raw[14 * 8 :]])  # without the header's CRC32
    assert raw.numel() == codec.HEADER_BYTES == 144 and v2.numel() == 128 and v3.numel() == 136
    back = codec.Header.from_bytes(v2)
    assert (back.step, back.fingerprint, back.elapsed_ms, back.grad_fingerprint, back.tag) == (3, 7, 6, 0, h.tag)
    assert codec.Header.from_bytes(v3).grad_fingerprint == 11
    assert codec.Header.from_bytes(raw) == h
