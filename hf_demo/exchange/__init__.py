"""How coefficients move between ranks: the exchanges (all-gather, all-reduce) and the transport under them."""
