"""The client: capture, Arrays (futures), dispatch, and the embedded local cluster."""
