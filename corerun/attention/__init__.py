"""corerun's built-in attention backend (the ``torch`` reference)."""
