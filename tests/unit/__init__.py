"""Unit tests: one module or function, no model weights, no services."""
