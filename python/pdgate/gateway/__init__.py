"""The OpenAI-compatible P/D gateway service."""

from pdgate.gateway.app import create_app

__all__ = ["create_app"]
