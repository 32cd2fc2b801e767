"""The wire format: header, indices and every value format round-trip exactly."""
import pytest
import torch

from hf_demo import codec
from hf_demo.blocks import plan


def test_header_round_trip():
    h = codec.Header(step=12345, layout_checksum=0xDEADBEEF, settings_checksum=7, flags=codec.FLAG_NONFINITE,
                     world_size=4, payload_bytes=1 << 40)
    b = h.to_bytes()
    assert b.dtype == torch.uint8 and b.numel() == codec.HEADER_BYTES
    assert codec.Header.from_bytes(b) == h


def test_indices_round_trip_full_16_bit_range():
    idx = torch.tensor([[0, 1, 32767, 32768], [65535, 4095, 12, 40000]])
    wire = codec.pack_indices(idx)
    assert wire.dtype == torch.uint8 and wire.numel() == 16
    back = codec.unpack_indices(torch.stack([wire, wire]), 2, 4)
    assert torch.equal(back[0], idx) and torch.equal(back[1], idx)


@pytest.mark.parametrize("fmt", codec.VALUE_FORMATS)
@pytest.mark.parametrize("nblocks,k", [(1, 1), (3, 5), (17, 32)])
def test_values_round_trip_exactly(fmt, nblocks, k):
    torch.manual_seed(nblocks * k)
    values = torch.randn(nblocks, k)
    sent, wire = codec.quantize(values, fmt)
    layout = plan((nblocks * 64,), 64, k)
    assert wire.numel() == codec.value_bytes(layout, fmt)
    decoded = codec.dequantize(torch.stack([wire, wire]), fmt, nblocks, k)
    assert torch.equal(decoded[0], sent) and torch.equal(decoded[1], sent)


def test_value_formats_mean_what_they_say():
    values = torch.tensor([[0.3, -1.7, 2.0, -0.5]])
    assert torch.equal(codec.quantize(values, "fp32")[0], values)
    assert torch.equal(codec.quantize(values, "bf16")[0], values.to(torch.bfloat16).float())
    sent, wire = codec.quantize(values, "sign")
    scale = torch.tensor(1.125).to(torch.bfloat16).float()   # mean |v|
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
        codec.quantize(torch.ones(1, 1), "int4")
