"""Graph runners: run the composed model for one step, eagerly (``eager``) or by CUDA-graph replay (``cuda``).

Importing this package imports no torch; the runners live in ``corerun.graph.eager`` and
``corerun.graph.cuda`` and are registered in ``corerun.plugin.builtin`` like any plugin's.
``graph: {runner: auto}`` is chosen like every kind's ``auto``, by :meth:`corerun.plugin.registry.Registry.select`:
each runner declares the devices it runs on and whether it captures graphs (which needs an attention
backend that declares ``cuda_graph_decode`` and no tensor-parallel collectives in a step).
"""
