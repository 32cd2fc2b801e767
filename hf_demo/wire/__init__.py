"""The wire format: headers, payload encoding of positions and values, checksums and tags."""
