"""Property-based tests of everything that parses what other ranks send: the header, payload rows and the
positions of ``exchange="all_reduce"``. Random, truncated, oversized, repeated-position and crafted inputs
(headers claiming huge sizes) give the library's own error (:class:`~hf_demo.errors.DeMoSyncError` or its
:class:`~hf_demo.errors.DeMoPayloadError`), never a raw ``ValueError``/``TypeError``/``RuntimeError``; a
parser reads nothing past the size the layout sets (rows of another size are refused before they are read);
and every example runs within hypothesis' deadline (nothing hangs)."""

import zlib

import pytest
import torch

from codec_helpers import decode_params, encode_params
from hf_demo.compression import plan
from hf_demo.errors import DeMoPayloadError, DeMoSyncError
from hf_demo.exchange import transport as exchanges
from hf_demo.wire import codec

hypothesis = pytest.importorskip("hypothesis")
st = pytest.importorskip("hypothesis.strategies")
given, settings = hypothesis.given, hypothesis.settings

FAST = settings(max_examples=60, deadline=2000, derandomize=True)
LAYOUTS = [plan((70, 10), 8, 5), plan((13,), 8, 3), plan((16, 8), 8, 5)]


def _signed(**kw) -> codec.Header:
    base = dict(step=3, layout_checksum=11, settings_checksum=7, flags=0, world_size=2, payload_bytes=96)
    return codec.sign(codec.Header(**{**base, **kw}), torch.zeros(0, dtype=torch.uint8), None)


def _tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)


@FAST
@given(st.binary(max_size=4 * codec.HEADER_BYTES))
def test_any_bytes_parse_as_a_header_or_give_a_named_error(raw):
    try:
        h = codec.Header.from_bytes(_tensor(raw))
    except DeMoSyncError as exc:
        assert "header of" in str(exc) and len(raw) != codec.HEADER_BYTES
        return
    assert len(raw) in (codec.HEADER_BYTES, 136, 128)
    assert isinstance(h.step, int) and len(h.tag) == codec.TAG_BYTES


@FAST
@given(st.one_of(st.integers(), st.text(max_size=4), st.just(torch.zeros(2, codec.HEADER_BYTES, dtype=torch.uint8))))
def test_a_header_from_something_else_than_bytes_is_named(thing):
    with pytest.raises(DeMoSyncError, match="flat uint8 tensor"):
        codec.Header.from_bytes(thing if not isinstance(thing, torch.Tensor) else thing.float())


@FAST
@given(st.binary(min_size=codec.HEADER_BYTES, max_size=codec.HEADER_BYTES), st.booleans())
def test_a_random_header_is_refused_by_its_crc_not_acted_on(raw, with_secret):
    own = _signed()
    rows = torch.stack([own.to_bytes(), _tensor(raw)])
    secret = b"s3cret" if with_secret else None
    headers, refusal = codec.receive_headers(rows, own, secret, rank=0, step=3)
    if codec.Header.from_bytes(_tensor(raw)).intact:  # a 1 in 2**32 chance: then its fields are compared
        return
    assert isinstance(refusal, DeMoPayloadError) and "header from rank 1" in str(refusal), refusal
    assert refusal.header_sender == 1
    assert headers[1].step == own.step and headers[1].payload_bytes == own.payload_bytes  # a stand-in that
    codec.check_headers(headers, 0)  # decides nothing: the ranks go on into the same collectives


@FAST
@given(
    st.sampled_from(["payload_bytes", "world_size", "step", "layout_checksum", "settings_checksum"]),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
)
def test_an_intact_header_claiming_huge_sizes_is_a_named_disagreement_before_anything_is_allocated(word, value):
    own = _signed()
    crafted = _signed(**{word: value})  # a valid CRC32: crafted, not corrupted
    headers, refusal = codec.receive_headers(torch.stack([own.to_bytes(), crafted.to_bytes()]), own, None, 0, 3)
    assert refusal is None
    if value == getattr(own, word):
        return
    with pytest.raises(DeMoSyncError, match="DeMo ranks disagree"):
        codec.check_headers(headers, 0)  # raised before the payload collective, whose size is this rank's own


@FAST
@given(st.integers(min_value=0, max_value=codec.HEADER_BYTES - 1), st.integers(min_value=0, max_value=7))
def test_every_single_flipped_header_bit_is_refused(byte, bit):
    own = _signed(flags=codec.FLAG_FINGERPRINT, fingerprint=12345)
    row = own.to_bytes().clone()
    row[byte] ^= 1 << bit
    _, refusal = codec.receive_headers(torch.stack([own.to_bytes(), row]), own, None, 0, 3)
    if byte >= codec.HEADER_WORDS * 8:  # the tag: unused without a secret
        assert refusal is None
    else:
        assert refusal is not None and "CRC32" in str(refusal)


def _pc(fmt, coding):
    return codec.PayloadCodec(LAYOUTS, fmt, coding)


@FAST
@given(
    st.sampled_from(codec.VALUE_FORMATS),
    st.sampled_from(codec.INDEX_CODINGS),
    st.integers(min_value=1, max_value=3),
    st.data(),
)
def test_random_payload_rows_decode_or_give_a_named_payload_error(fmt, coding, world, data):
    pc = _pc(fmt, coding)
    raw = data.draw(st.binary(min_size=world * pc.nbytes, max_size=world * pc.nbytes))
    rows = _tensor(raw).view(world, pc.nbytes)
    try:
        decoded = decode_params(pc, rows)
    except DeMoPayloadError as exc:
        assert "rank(s)" in str(exc)
        return
    for (idx, values), layout in zip(decoded, LAYOUTS):
        assert int(idx.max()) < layout.bsize and bool(values.isfinite().all())
        assert all(len(set(block.tolist())) == layout.k for block in idx.reshape(-1, layout.k))  # no repeats


@FAST
@given(st.sampled_from(codec.INDEX_CODINGS), st.integers(min_value=0, max_value=400))
def test_truncated_or_oversized_payload_rows_are_refused_before_they_are_read(coding, width):
    pc = _pc("bf16", coding)
    rows = torch.zeros(2, width, dtype=torch.uint8)
    if width == pc.nbytes:
        return
    with pytest.raises(DeMoPayloadError, match="truncated or oversized"):
        decode_params(pc, rows)


@FAST
@given(st.sampled_from(codec.INDEX_CODINGS), st.integers(min_value=0, max_value=4), st.data())
def test_repeated_positions_are_refused_in_every_index_coding(coding, block, data):
    pc = _pc("fp32", coding)
    selections = []
    for layout in LAYOUTS:
        idx = torch.arange(layout.k).repeat(layout.nblocks, 1)
        selections.append((idx, torch.ones(layout.nblocks, layout.k)))
    good = encode_params(pc, selections, "cpu")[0]
    param = data.draw(st.integers(min_value=0, max_value=len(LAYOUTS) - 1))
    layout = LAYOUTS[param]
    idx = selections[param][0].clone()
    row = block % layout.nblocks
    idx[row, 1:] = idx[row, 0]  # one block names its first position k times
    bad = encode_params(pc, [*selections[:param], (idx, selections[param][1]), *selections[param + 1 :]], "cpu")[0]
    with pytest.raises(
        DeMoPayloadError,
        match=rf"(repeated positions \(a block naming one position twice\)|out-of-range indices) for parameter {param}",
    ):
        decode_params(pc, torch.stack([good, bad]))


@FAST
@given(st.sampled_from(codec.INDEX_CODINGS), st.sampled_from(["union", "leader"]), st.data())
def test_random_all_reduce_positions_are_chosen_or_refused_with_a_named_payload_error(coding, positions, data):
    spec = exchanges.ExchangeSpec(LAYOUTS, "fp32", coding, world=2, positions=positions)
    ex = exchanges.AllReduceExchange(spec)
    senders = 2 if positions == "union" else 1
    raw = data.draw(st.binary(min_size=senders * ex.index_nbytes, max_size=senders * ex.index_nbytes))
    rows = _tensor(raw).view(senders, ex.index_nbytes)
    try:
        chosen = ex._chosen(rows, rank=0, step=3, world=2)
    except DeMoPayloadError as exc:
        assert "positions" in str(exc) and "for parameter" in str(exc), exc
        return
    for (idx, _), bucket in zip(chosen, ex.picked.buckets):
        assert int(idx.max()) < bucket.bsize
    with pytest.raises(DeMoPayloadError, match="truncated or oversized"):
        ex._chosen(rows[:, :-1], rank=0, step=3, world=2)


def test_headers_and_rows_of_odd_sizes_give_named_errors_not_raw_ones():
    """The minor findings: odd sizes raised a raw ValueError/TypeError from the parsers."""
    with pytest.raises(DeMoSyncError, match="header of 137 bytes"):
        codec.Header.from_bytes(torch.zeros(137, dtype=torch.uint8))
    header = _signed()
    with pytest.raises(DeMoPayloadError, match="headers for received rows"):
        codec.verify_rows([header], torch.zeros(7, dtype=torch.uint8), None, rank=0, step=3)
    with pytest.raises(DeMoPayloadError, match="uint8 tensor"):
        decode_params(_pc("bf16", "uint16"), torch.zeros(2, 5))
    assert zlib.crc32(header.body_bytes()) == header.header_crc
