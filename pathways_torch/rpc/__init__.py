"""Wire format: generated gRPC stubs, the tensor codec and channel settings."""
