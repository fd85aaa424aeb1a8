"""Tooling above the services: the process launcher (tests, benchmarks) and the stub generator.

Like `zerobubble.entrypoints`, nothing in the services or the ground floor imports it.
"""
