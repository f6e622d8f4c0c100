"""Deliberately broken implementations: the conformance suite must reject each one.

Each broken class differs from a small correct one in this package by a single override, and the
correct one passes the suite (``tests/test_conformance_rejects.py`` shows both).
"""
