"""What a model is: the handler contract and a batch's result (``base``), the built-in loaders
(``torch_formats``, ``onnx_format``), and the model repository (``repository``). How a model
runs (the runner and its stages) is ``app.serving.runner``.

Nothing here imports aiohttp or ``app.serving``; the loaders run on the model's threads. This
package imports nothing itself, so that the request path (the serving core, the routes) can use
``repository`` and ``base`` without importing torch.
"""
