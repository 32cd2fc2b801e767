"""Every rank's headers sealed, or none, decided alike on every rank at a process's first exchange.

A rank that receives headers both sealed and in the clear cannot tell a real mix (ranks with different
``HF_DEMO_ENCRYPT`` settings, whose payloads then differ in size) from a header rewritten on its way to it alone (an
intact clear header put in place of a sealed one, or the seal's marker written into a clear one). Before any
payload-sized collective of a process's first exchange, every rank says in a word of :data:`WORD_BYTES` what it
saw and whether it seals (:func:`agree`): a rank that saw a mix, itself or in a word it can trust, raises the same
:class:`DeMoSyncError` as every other rank. A word this rank cannot trust (corrupted, forged, or from a rank with
another secret) is a refusal voted on with the step (the payloads then have one size: this rank saw no mix).
Every later exchange needs no such round: the first one committed proves every rank seals alike, so a header of
the other kind is refused where it arrives (it does not open, or fails its CRC32) and voted on."""

from __future__ import annotations

import hashlib
import hmac
import struct
import zlib
from dataclasses import dataclass

import torch

from hf_demo.errors import DeMoPayloadError, DeMoSyncError
from hf_demo.wire import codec, sealing

WORD_BYTES = 32  # what the rank says (1), zeros (11), CRC32 (4), HMAC-SHA256 truncated (16); the step travels not
SEALS = 1  # the sender seals its traffic (HF_DEMO_ENCRYPT=1)
SAW_MIX = 2  # the sender received headers both sealed and in the clear
SIGNED = 4  # the word carries an HMAC of HF_DEMO_SECRET
REFUSED_AUTH = 8  # the sender refused a header for its HMAC, its seal or its signing (codec.header_refused)
_DOMAIN = b"hf_demo first-exchange sealing word"
UNTRUSTED_WORD = (
    "came with a word of the first exchange's sealing round that fails its CRC32 or HMAC (corrupted or rewritten "
    "on the way, or another HF_DEMO_SECRET)"
)


@dataclass(frozen=True)
class Word:
    seals: bool
    saw_mix: bool
    refused_auth: bool = False


def mix(rows: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """(the ranks whose header row is sealed, those whose is an intact clear header) where both exist, else None.
    A row that is neither (a sealed one corrupted on the way) is left to the headers' own checks."""
    sealed = [r for r, row in enumerate(rows) if sealing.is_sealed(row)]
    clear = [r for r in range(rows.shape[0]) if r not in sealed and _clear_header(rows[r])]
    return (sealed, clear) if sealed and clear else None


def _clear_header(row: torch.Tensor) -> bool:
    h = codec.Header.from_bytes(row.contiguous())
    return h.magic == codec.MAGIC and h.intact


def encode(step: int, sender: int, word: Word, secret: bytes | None) -> torch.Tensor:
    """This rank's word: its CRC32 and, with a secret, its HMAC both bind the step and the sender's global rank,
    which it does not carry."""
    bits = (SEALS if word.seals else 0) | (SAW_MIX if word.saw_mix else 0) | (SIGNED if secret is not None else 0)
    bits |= REFUSED_AUTH if word.refused_auth else 0
    body = struct.pack("<B11x", bits)
    crc = zlib.crc32(body + _bound(step, sender))
    tag = _tag(body, step, sender, secret) if secret is not None else bytes(16)
    return torch.frombuffer(bytearray(body + struct.pack("<I", crc) + tag), dtype=torch.uint8)


def _bound(step: int, sender: int) -> bytes:
    return struct.pack("<QI", step, sender)


def _tag(body: bytes, step: int, sender: int, secret: bytes) -> bytes:
    return hmac.new(secret, _DOMAIN + body + _bound(step, sender), hashlib.sha256).digest()[:16]


def decode(row: torch.Tensor, step: int, sender: int, secret: bytes | None) -> Word | None:
    """A received word, or None where this rank cannot trust it: its CRC32 fails, it is of another step or sender,
    it is signed where this rank holds no secret (or not where it does), or its HMAC fails."""
    raw = bytes(row.cpu().tolist())
    body, (crc,), tag = raw[:12], struct.unpack("<I", raw[12:16]), raw[16:WORD_BYTES]
    if zlib.crc32(body + _bound(step, sender)) != crc:
        return None
    (bits,) = struct.unpack("<B11x", body)
    if bool(bits & SIGNED) != (secret is not None):
        return None
    if secret is not None and not hmac.compare_digest(_tag(body, step, sender, secret), tag):
        return None
    return Word(bool(bits & SEALS), bool(bits & SAW_MIX), bool(bits & REFUSED_AUTH))


def agree(transport, rows: torch.Tensor, secret, sealer, device, refusal=None) -> DeMoPayloadError | None:
    """The sealing round of a process's first exchange, after its headers' all-gather (``rows``: every rank's
    header row; ``refusal``: this rank's of one of them) and before any payload-sized collective. Raises the same
    :class:`DeMoSyncError` on every rank where any rank saw headers both sealed and in the clear. Returns the
    refusal this rank votes with: its own; else that of a word it cannot trust; else, where another rank says it
    refused a header for its authentication, that refusal relayed (so that every rank raises the same error in
    the settling round, also where that rank's settling row is corrupted on its way); else None."""
    step, me, seen = transport.step, transport.rank, mix(rows)
    own = Word(sealer is not None, seen is not None, bool(getattr(refusal, "unauthentic", False)))
    word = encode(step, _sender(transport, me), own, secret).to(device)
    gathered = transport.all_gather(word, "sealing", count=False).cpu()  # a set-up round: not in comm_stats
    words = [
        own if r == me else decode(gathered[r], step, _sender(transport, r), secret) for r in range(gathered.shape[0])
    ]
    saw = [r for r, w in enumerate(words) if w is not None and w.saw_mix]
    if saw:
        raise DeMoSyncError(_mixed(step, words, saw, seen))
    untrusted = [r for r, w in enumerate(words) if w is None]
    refused = [r for r, w in enumerate(words) if w is not None and w.refused_auth]
    if refusal is not None:
        return refusal
    if untrusted:
        return codec.header_refused(me, untrusted[0], step, UNTRUSTED_WORD, unauthentic=True)
    if refused:
        return _relayed(me, refused[0], step)
    return None


def _relayed(rank: int, by: int, step: int) -> DeMoPayloadError:
    """Rank ``by``'s refusal of a header for its authentication, as this rank votes it (marked ``unauthentic``)."""
    error = DeMoPayloadError(
        f"rank {rank}: rank {by} refused a header at optimizer step {step} for its authentication (its HMAC, its "
        "seal or its signing), as it said in the first exchange's sealing round; nothing was applied"
    )
    error.unauthentic = True
    return error


def _sender(transport, r: int) -> int:
    return transport.global_rank(r)


def _mixed(step: int, words: list, saw: list[int], seen) -> str:
    """The error every rank raises alike: from the words where this rank trusts them all (every rank reads the
    same), else from the header rows this rank saw a mix in (a real mix: every rank saw the same rows)."""
    if all(w is not None for w in words):
        sealed = [r for r, w in enumerate(words) if w.seals]
        clear = [r for r, w in enumerate(words) if not w.seals]
    elif seen is not None:
        sealed, clear = seen
    else:
        sealed, clear = [], []
    if sealed and clear:
        return (
            f"DeMo ranks disagree: rank(s) {sealed} encrypt their traffic and rank(s) {clear} send it in the clear: "
            f"set the same HF_DEMO_SECRET and {sealing.ENCRYPT_ENV}=1 on every rank"
        )
    return (
        f"DeMo: at this process's first exchange (optimizer step {step}) rank(s) {saw} received headers both sealed "
        "and in the clear, though the ranks say they all send their traffic alike: headers rewritten or corrupted "
        "on the way (injected traffic, a faulty link). Nothing was applied; run the step again"
    )
