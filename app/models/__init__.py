"""Model runtime: the handler contract, built-in loaders and the runner.

Nothing here imports aiohttp; everything here runs on the worker's inference thread.
"""

from app.models.base import Handler
from app.models.runner import ModelRunner

__all__ = ["Handler", "ModelRunner"]
