"""The benchmark's workers, one per engine: each runs as a script in its own interpreter (``python WORKER.py
REQUEST.json RESULT.json``); a package so that the layer contract reads their imports too."""
