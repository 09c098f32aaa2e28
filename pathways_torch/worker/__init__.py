"""The worker: one host agent per host, and one executor process per slice on it."""
