"""kvcache-example: an example third-party kvcache backend plugin."""

from .backend import ExampleBackend

__all__ = ["ExampleBackend"]
