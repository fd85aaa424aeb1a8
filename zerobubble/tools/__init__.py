"""Tooling above the services: the process launcher (tests, benchmarks), the stub generator,
the flag tables, and the model tooling that uses the worker's model code without serving
(EAGLE head training and evaluation, the precision quality measure).

Like `zerobubble.entrypoints`, nothing in the services or the ground floor imports it.
"""
