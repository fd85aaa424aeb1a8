"""Helpers the tests share: oracles, harnesses, servers on loopback, statistics."""
