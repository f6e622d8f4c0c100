"""Running one step: ``ModelRunner`` (composition of model, attention, KV cache, graph runner and
sampler; ``execute(batch)``, which is ``prepare_step`` (host), ``execute_model`` (the forward) and
``sample_tokens`` (sampling, the one host sync): asynchronous scheduling runs the last two on its step
thread), ``step_inputs`` (the step's tensors in one staging buffer) and
``profile`` (the step-memory profile that sizes the KV cache)."""
