"""Confidential, sender-bound DeMo traffic (opt-in): what DeMo sends, encrypted and authenticated (AES-256-GCM).

Switched on by ``HF_DEMO_ENCRYPT=1`` beside ``HF_DEMO_SECRET``, both read once when :class:`hf_demo.DeMo` is
built; it needs the ``cryptography`` package (``pip install 'hf-demo[secure]'``). It then replaces the HMAC tags
of :mod:`hf_demo.wire.codec` on the headers, the payloads, the commit vote and rank 0's parameters of a resync.

Keys. Every optimizer draws a fresh 8-byte session id when it is built. A rank seals with
``HKDF-SHA256(HF_DEMO_SECRET, salt=session id, info="hf-demo/seal/v1/sender/<global rank>")``: one key per
sender and process. Only a holder of the secret can seal, and a receiver opens each row with the key of the rank
whose row it is, so a row of rank 0 put in rank 1's place does not open.

Nonces. ``(step, try, sender, kind)`` in 12 bytes: the optimizer step, the sender's count of headers sealed in
this process (each try of a step has its own: a step refused and run again, the budget policy's retry in a lower
tier), its global rank, and what is sealed (header, payload, vote, resync). The count only grows and the session
id is new in every process, so a nonce never repeats under a key, also after a restart from a checkpoint.

On the wire. A header becomes ``prefix + AES-GCM(header words) + 16-byte tag``, exactly as long as a clear header
(:data:`~hf_demo.wire.codec.HEADER_BYTES`); the prefix (a marker, the try, the session id) is the only readable
part and is authenticated as associated data. A payload becomes its ciphertext and a 16-byte tag, a length fixed
per layout, so the all-gathers keep their agreed shapes; its associated data is its sender's prefix and header
words, so a payload opens only beside the header it was sent with.

Refusals. A row that does not open (another secret, a flipped bit, another rank's row, a row of another step or
try) is refused, and so is a header whose try is not beyond the last one accepted from its sender (a replay) or
that comes from another session of its sender than the first one seen. A header or payload refusal is a
:class:`~hf_demo.errors.DeMoPayloadError`, voted on like a bad CRC32 or HMAC (at a process's first exchange, a
header that does not open makes every rank raise the same :class:`~hf_demo.errors.DeMoSyncError`, naming
corruption and another secret alike: :func:`hf_demo.optim.settle.vote`). A mix of ranks that encrypt and
ranks that do not stops every rank alike at a process's first exchange (:func:`hf_demo.wire.uniform.agree`).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import torch

from hf_demo.errors import DeMoPayloadError, DeMoSyncError
from hf_demo.refusals import refuse
from hf_demo.wire import codec

ENCRYPT_ENV = "HF_DEMO_ENCRYPT"
EXTRA = "pip install 'hf-demo[secure]'  (or: pip install 'cryptography>=42')"
MARKER = b"DMS1"  # the first bytes of a sealed header (a clear one starts with codec.MAGIC)
TAG_BYTES = 16  # AES-GCM's tag: what sealing adds to a payload
SESSION_BYTES = 8
KINDS = {"header": 1, "payload": 2, "vote": 3, "resync": 4, "settings_sizes": 5, "settings": 6}
MAX_STEP = 2**40  # the step's 5 bytes of the nonce
MAX_TRIES = 2**32 - 1
KEY_INFO = "hf-demo/seal/v1/sender/{sender}"


def _crypto():
    """(AESGCM, InvalidTag, derive(secret, salt, info) -> 32-byte key) from ``cryptography``, or a clear error."""
    try:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError as exc:
        raise ImportError(
            f"DeMo: {ENCRYPT_ENV}=1 encrypts with the cryptography package, not installed: {EXTRA}"
        ) from exc

    def derive(secret: bytes, salt: bytes, info: bytes) -> bytes:
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(secret)

    return AESGCM, InvalidTag, derive


def from_env(secret: bytes | None, settings, environ=None) -> Sealer | None:
    """The optimizer's :class:`Sealer` when ``HF_DEMO_ENCRYPT=1`` (None when unset or 0); raises ``ValueError``
    naming the fix for a bad value, a missing secret or settings whose traffic cannot be sealed."""
    value = (os.environ if environ is None else environ).get(ENCRYPT_ENV, "").strip()
    if value in ("", "0"):
        return None
    if value != "1":
        raise ValueError(f"DeMo: {ENCRYPT_ENV}={value!r}: set 1 to encrypt DeMo's traffic, or 0 (or unset) not to")
    if secret is None:
        refuse("encrypted_without_secret", env=ENCRYPT_ENV)
    if settings.exchange != "all_gather":
        refuse("encrypted_all_reduce", env=ENCRYPT_ENV, exchange=settings.exchange)
    return Sealer(secret)


def nonce(step: int, tries: int, sender: int, kind: str) -> bytes:
    """The 12-byte AES-GCM nonce of (step, try, sender, kind)."""
    if not 0 <= step < MAX_STEP:
        raise DeMoSyncError(f"DeMo: optimizer step {step} is beyond what encrypted traffic numbers (< 2**40)")
    return struct.pack("<BHI", KINDS[kind], sender & 0xFFFF, tries) + step.to_bytes(5, "little")


def prefix_bytes() -> int:
    """The clear prefix of a sealed header: what makes it exactly as long as a clear one."""
    words = codec.HEADER_WORDS * 8
    n = codec.HEADER_BYTES - words - TAG_BYTES
    assert n >= len(MARKER) + 4 + SESSION_BYTES, "a clear header too short to seal in place"
    return n


def is_sealed(row: torch.Tensor) -> bool:
    return bytes(row[: len(MARKER)].tolist()) == MARKER


def _unopened(message: str) -> DeMoSyncError:
    """A header row that does not open (marked ``unopened``: corruption and another secret explain it alike)."""
    error = DeMoSyncError(message)
    error.unopened = True
    return error


@dataclass(frozen=True)
class Envelope:
    """What a receiver knows of a row's sender from its opened header: what opens the rest of that try."""

    sender: int  # global rank
    session: bytes
    tries: int
    aad: bytes  # the header's prefix and words: the associated data of everything else it sends in this try


class Sealer:
    """One optimizer's keys and counters: seals what this rank sends, opens what it receives."""

    def __init__(self, secret: bytes):
        self._aead, self._invalid, self._derive = _crypto()
        self._secret = secret
        self.session = os.urandom(SESSION_BYTES)
        self.tries = 0  # headers sealed by this process (every try of every step)
        self._keys: dict = {}
        self._seen: dict[int, tuple[bytes, int]] = {}  # sender -> (session, last try accepted)
        self.mine: Envelope | None = None  # this rank's, from its last sealed header
        self.envelopes: list[Envelope] = []  # every row's sender, from the last headers opened

    def __repr__(self) -> str:  # never the secret
        return f"Sealer(session={self.session.hex()}, tries={self.tries})"

    def _key(self, sender: int, session: bytes):
        if (sender, session) not in self._keys:
            info = KEY_INFO.format(sender=sender).encode()
            self._keys[(sender, session)] = self._aead(self._derive(self._secret, session, info))
        return self._keys[(sender, session)]

    # ------------------------------------------------------------ headers
    def seal_header(self, header: codec.Header, step: int, sender: int) -> torch.Tensor:
        """This rank's header, sealed for ``step`` (a new try): uint8, as long as a clear header."""
        if self.tries >= MAX_TRIES:
            raise DeMoSyncError("DeMo: this process sealed 2**32 - 1 headers; restart it for a fresh session")
        self.tries += 1
        prefix = (MARKER + struct.pack("<I", self.tries) + self.session).ljust(prefix_bytes(), b"\0")
        words = header.words_bytes()
        sealed = self._key(sender, self.session).encrypt(nonce(step, self.tries, sender, "header"), words, prefix)
        self.mine = Envelope(sender, self.session, self.tries, prefix + words)
        return torch.frombuffer(bytearray(prefix + sealed), dtype=torch.uint8)

    def open_headers(
        self, rows: torch.Tensor, step: int, senders: list[int], rank: int, own: codec.Header | None = None
    ) -> list[codec.Header] | tuple:
        """Every rank's sealed header (world, HEADER_BYTES) -> the headers; raises :class:`DeMoSyncError` on a row
        that does not open or is a replay. With ``own`` (this rank's header: a step's headers, a settling round's
        rows), such a row is refused instead: (headers, refusal) with :func:`codec.stand_in` in its
        place and the refusal a :class:`DeMoPayloadError` naming its sender, voted on like a header that fails its
        HMAC. The counters move for the rows that open."""
        headers, envelopes, refused = [], [], []
        for r, (row, sender) in enumerate(zip(rows.cpu(), senders)):
            try:
                header, envelope = self._open_header(row, step, sender, r, rank)
            except DeMoSyncError as exc:
                if own is None:
                    raise
                why = str(exc).split(f"at optimizer step {step} ", 1)[-1]
                refused.append((r, why, getattr(exc, "unopened", False)))
                header, envelope = codec.stand_in(own), None
            headers.append(header)
            envelopes.append(envelope)
        for e in envelopes:
            if e is not None:
                self._seen[e.sender] = (e.session, e.tries)
        self.envelopes = envelopes
        if own is None:
            return headers
        if not refused:
            return headers, None
        sender, why, unopened = refused[0]
        return headers, codec.header_refused(rank, sender, step, why, unauthentic=unopened)

    def _open_header(self, row: torch.Tensor, step: int, sender: int, r: int, rank: int) -> tuple:
        """One sealed header row -> (header, envelope); raises :class:`DeMoSyncError` where it does not open."""
        n = prefix_bytes()
        raw = row.numpy().tobytes()
        prefix, tries, session = raw[:n], *struct.unpack("<I", raw[4:8]), raw[8 : 8 + SESSION_BYTES]
        where = f"rank {rank}: the header from rank {r} at optimizer step {step}"
        if not is_sealed(row):
            raise _unopened(f"{where} is not sealed (corrupted on the way, or injected traffic): refused")
        self._check_fresh(sender, session, tries, where)
        try:
            words = self._key(sender, session).decrypt(nonce(step, tries, sender, "header"), raw[n:], prefix)
        except self._invalid:
            raise _unopened(
                f"{where} does not open with rank {r}'s key for this HF_DEMO_SECRET (AES-256-GCM): refused (a "
                "different secret, a flipped bit, a header of another rank, step or try, or injected traffic)"
            ) from None
        padded = bytearray(words + bytes(codec.HEADER_BYTES - len(words)))
        header = codec.Header.from_bytes(torch.frombuffer(padded, dtype=torch.uint8))
        return header, Envelope(sender, session, tries, prefix + words)

    def _check_fresh(self, sender: int, session: bytes, tries: int, where: str) -> None:
        seen = self._seen.get(sender)
        if seen is None:
            return
        if seen[0] != session:
            raise DeMoSyncError(
                f"{where} carries a session id that rank has not sent with so far (another rank's header in its "
                "place, or a recording of an earlier process or run): refused"
            )
        if tries <= seen[1]:
            raise DeMoSyncError(
                f"{where} is a replay: its try {tries} is not beyond the last one accepted from that rank "
                f"({seen[1]}): refused"
            )

    # ------------------------------------------------------------ payloads, votes, resyncs
    def seal(self, buf: torch.Tensor, step: int, kind: str) -> torch.Tensor:
        """This rank's ``buf`` (uint8) of this try, sealed: ciphertext and tag, ``buf.numel() + 16`` bytes, on
        ``buf``'s device."""
        mine = self.mine
        plain = buf.detach().cpu().contiguous().numpy().tobytes()
        sealed = self._key(mine.sender, mine.session).encrypt(
            nonce(step, mine.tries, mine.sender, kind), plain, mine.aad
        )
        return torch.frombuffer(bytearray(sealed), dtype=torch.uint8).to(buf.device)

    def open_rows(self, rows: torch.Tensor, step: int, kind: str, rank: int, only=None, envelopes=None) -> torch.Tensor:
        """Every sender's sealed row (world, n + 16) -> the rows (world, n) on ``rows``' device; raises
        :class:`DeMoPayloadError` naming the first row that does not open. ``only``: the rows to open (the
        others come back as zeros); ``envelopes``: the senders' of the step that sent them (overlap: an earlier
        step's), by default those of the last headers opened."""
        host = rows.detach().cpu()
        out = torch.zeros(host.shape[0], host.shape[1] - TAG_BYTES, dtype=torch.uint8)
        for r, (row, envelope) in enumerate(zip(host, self.envelopes if envelopes is None else envelopes)):
            if only is not None and r not in only:
                continue
            e = envelope
            if e is None:  # its header was refused: nothing of that try opens
                raise DeMoPayloadError(
                    f"rank {rank}: the {kind} from rank {r} at optimizer step {step} comes with a header this rank "
                    "refused: refused; nothing was applied"
                )
            try:
                plain = self._key(e.sender, e.session).decrypt(
                    nonce(step, e.tries, e.sender, kind), row.numpy().tobytes(), e.aad
                )
            except self._invalid:
                raise DeMoPayloadError(
                    f"rank {rank}: the {kind} from rank {r} at optimizer step {step} does not open with rank {r}'s "
                    "key for this HF_DEMO_SECRET (AES-256-GCM): refused (a different secret, a flipped bit, a "
                    "payload of another rank, step or try, or injected traffic); nothing was applied"
                ) from None
            if plain:
                out[r] = torch.frombuffer(bytearray(plain), dtype=torch.uint8)
        return out.to(rows.device)
