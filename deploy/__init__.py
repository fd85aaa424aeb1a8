"""Deployment assets (container files, Kubernetes manifests) and their offline checker.

Run ``python -m deploy.check`` (``make deploy-check``) to render and validate every overlay.
"""
