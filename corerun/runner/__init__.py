"""Running one step: ``ModelRunner`` (composition of model, attention, KV cache, graph runner and
sampler; ``execute(batch)``), ``step_inputs`` (the step's tensors in one staging buffer) and
``profile`` (the step-memory profile that sizes the KV cache)."""
