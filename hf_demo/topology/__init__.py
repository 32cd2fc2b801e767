"""Which ranks exchange with which, and which parameters and gradients each rank handles."""
