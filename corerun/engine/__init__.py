"""Requests, scheduling and the step loop."""
