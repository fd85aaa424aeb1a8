"""Deployment tests: manifests, monitoring, packaging and the device check."""
