"""Model runtime: the handler contract (``base``), built-in loaders, the runner, the model
repository and the unit of a batch's result (``segment``).

Nothing here imports aiohttp; the runner and the loaders run on the model's inference thread.
This package imports nothing itself, so that the request path (the batcher, the app state, the
routes) can use ``repository`` and ``segment`` without importing torch.
"""
