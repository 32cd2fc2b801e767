"""The per-parameter math: blocks and transforms (DCT), momentum, top-k, error feedback, averaging."""
