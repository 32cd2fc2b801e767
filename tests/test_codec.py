"""The wire protocol: header, indices, every value format and the payload round-trip exactly and are checked."""

import pytest
import torch

from hf_demo import codec
from hf_demo.blocks import plan
from hf_demo.errors import DeMoSyncError


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
    wire = codec.pack_indices(idx)
    assert wire.dtype == torch.uint8 and wire.numel() == 16 and wire.device == device
    assert torch.equal(wire.cpu(), codec.pack_indices(idx.cpu()))
    back = codec.unpack_indices(torch.stack([wire, wire]), 2, 4)
    assert torch.equal(back[0], idx) and torch.equal(back[1], idx)


@pytest.mark.parametrize("fmt", codec.VALUE_FORMATS)
@pytest.mark.parametrize("nblocks,k", [(1, 1), (3, 5), (17, 32)])
def test_values_round_trip_exactly(fmt, nblocks, k, device):
    torch.manual_seed(nblocks * k)
    values = torch.randn(nblocks, k).to(device)
    f = codec.value_format(fmt)
    sent, wire = f.encode(values)
    assert wire.numel() == f.nbytes(nblocks, k) and wire.device == sent.device == device
    assert torch.equal(wire.cpu(), f.encode(values.cpu())[1])  # the same bytes from every device
    decoded = f.decode(torch.stack([wire, wire]), nblocks, k)
    assert torch.equal(decoded[0], sent) and torch.equal(decoded[1], sent)


def test_value_formats_mean_what_they_say():
    values = torch.tensor([[0.3, -1.7, 2.0, -0.5]])
    assert torch.equal(codec.value_format("fp32").encode(values)[0], values)
    assert torch.equal(codec.value_format("bf16").encode(values)[0], values.to(torch.bfloat16).float())
    sent, wire = codec.value_format("sign").encode(values)
    scale = torch.tensor(1.125).to(torch.bfloat16).float()  # mean |v|
    assert torch.equal(sent, scale * torch.tensor([[1.0, -1.0, 1.0, -1.0]]))
    assert wire.numel() == 8  # 2-byte scale + 1 byte of bits, each 4-aligned


def test_wire_cost_per_coefficient():
    layout = plan((576, 576), 64, 32)
    per_param = {f: codec.segment_bytes(layout, f) / layout.numel for f in codec.VALUE_FORMATS}
    assert per_param["bf16"] == pytest.approx(4 * 32 / 4096)
    assert per_param["fp32"] == pytest.approx(6 * 32 / 4096)
    assert per_param["sign"] <= 0.02


def test_unknown_format():
    with pytest.raises(ValueError, match="value format"):
        codec.value_format("int4")


def _payload(fmt="bf16", device="cpu"):
    torch.manual_seed(0)
    layouts = [plan((70, 10), 8, 5), plan((13,), 8, 3)]
    pc = codec.PayloadCodec(layouts, fmt)
    selections = [
        (torch.randn(lay.nblocks, lay.bsize).abs().topk(lay.k, 1).indices, torch.randn(lay.nblocks, lay.k))
        for lay in layouts
    ]
    selections = [(idx.to(device), values.to(device)) for idx, values in selections]
    payload, sent = pc.encode(selections, device)
    return pc, selections, payload, sent


@pytest.mark.parametrize("fmt", codec.VALUE_FORMATS)
def test_payload_round_trip(fmt, device):
    pc, selections, payload, sent = _payload(fmt, device)
    assert payload.numel() == pc.nbytes and payload.device == device
    assert torch.equal(payload.cpu(), _payload(fmt)[2])  # the same bytes from every device
    rows = torch.stack([payload, payload])
    headers = [codec.sign(_header(), payload, b"k")] * 2
    assert headers[0].payload_crc == codec.crc32(payload.cpu())
    codec.verify_rows(headers, rows, b"k", rank=0, step=0)  # CRC32 and HMAC of device rows, on the host
    decoded = pc.decode(rows)
    for (idx, _), values, (d_idx, d_values) in zip(selections, sent, decoded):
        assert d_idx.device == d_values.device == device
        assert torch.equal(d_idx[1], idx) and torch.equal(d_values[1], values)


def test_payload_decode_names_out_of_range_indices_and_nan_values():
    pc, _, payload, _ = _payload("fp32")
    bad = payload.clone()
    bad[:2] = 255  # first index of the first block: 65535 >= 64
    with pytest.raises(DeMoSyncError, match=r"out-of-range indices for parameter 0 .* rank\(s\) \[1\]"):
        pc.decode(torch.stack([payload, bad]))
    bad = payload.clone()
    off = codec.index_bytes(pc.layouts[0])
    bad[off : off + 4] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)  # fp32 NaN
    with pytest.raises(DeMoSyncError, match=r"NaN/Inf coefficients for parameter 0 .* rank\(s\) \[0\]"):
        pc.decode(torch.stack([bad, payload]))


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
    replayed = codec._replace(good, step=good.step + 1)
    with pytest.raises(DeMoSyncError, match="HMAC"):
        codec.verify_rows([replayed], payload[None], b"s3cret", rank=0, step=0)


def test_check_headers_names_every_disagreement():
    ref = _header(flags=0)
    with pytest.raises(DeMoSyncError, match="rank 1 is at optimizer step 12346"):
        codec.check_headers([ref, codec._replace(ref, step=12346)], 0)
    with pytest.raises(DeMoSyncError, match="different optimizer settings"):
        codec.check_headers([ref, codec._replace(ref, settings_checksum=8)], 0)
    with pytest.raises(DeMoSyncError, match="HF_DEMO_SECRET"):
        codec.check_headers([ref, codec._replace(ref, flags=codec.FLAG_AUTH)], 0)
    codec.check_headers([ref, codec._replace(ref, flags=codec.FLAG_NONFINITE)], 0)  # flags may differ


def test_a_format_2_header_still_parses():
    """Optimizer states of format 2 may hold the 12-word headers of an in-flight overlap exchange."""
    h = codec.Header(step=3, layout_checksum=1, settings_checksum=2, flags=4, world_size=2, payload_bytes=10,
                     payload_crc=9, fingerprint=7, exchange_ms=5, elapsed_ms=6, grad_fingerprint=11)  # fmt: skip
    raw = h.to_bytes()
    v2 = torch.cat([raw[: 12 * 8], raw[13 * 8 :]])  # without the 13th word (grad_fingerprint)
    assert raw.numel() == codec.HEADER_BYTES == 136 and v2.numel() == 128
    back = codec.Header.from_bytes(v2)
    assert (back.step, back.fingerprint, back.elapsed_ms, back.grad_fingerprint, back.tag) == (3, 7, 6, 0, h.tag)
    assert codec.Header.from_bytes(raw) == h
