"""DeMo keywords as a command line writes them: ``key=value,...`` (``convergence.py --demo-configs``,
``wan_worker.py --demo-settings``), with short keys for the compression settings."""

ALIASES = {  # short keys of the command lines
    "topk": "compression_topk",
    "chunk": "compression_chunk",
    "decay": "compression_decay",
    "format": "value_format",
}


def _value(text: str):
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text.strip()


def parse_overrides(spec: str) -> dict:
    """``key=value,...`` -> DeMo keywords: short keys expanded (:data:`ALIASES`), values int, float, true/false
    or text (DeMo validates them)."""
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if "=" not in item:
            raise SystemExit(f"DeMo override {item!r} is not key=value")
        k, v = item.split("=", 1)
        out[ALIASES.get(k.strip(), k.strip())] = _value(v)
    return out
