"""The coordinator: resource manager over islands, hosts and devices, and client sessions."""
