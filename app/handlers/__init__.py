"""Python model handlers, referenced from a model's ``model.toml`` as ``handler = "module:Class"``.

A handler is built with no arguments on the worker's event loop, then driven through four verbs
on the model's threads (``app.models.base`` says which thread runs which):

``load(device, config)``
    Load weights onto ``device``; ``config`` is the model's parsed ``model.toml``.
``preprocess(inputs) -> batch``
    Batched numpy inputs (axis 0 = items) to device tensors. Runs on the CPU.
``predict(batch) -> outputs``
    The forward pass; the server wraps it in ``torch.inference_mode()``.
``postprocess(outputs) -> {name: ndarray}``
    One numpy array per declared output, axis 0 = items, dtype matching the declared datatype.

Handler modules are imported by name only when a model names them, so this package imports
nothing heavy itself.
"""
