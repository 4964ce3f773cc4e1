"""The serving core: the model registry (typed app state), the dynamic batcher, the inference
thread, and the model lifecycle (load, warmup, drain, unload)."""
