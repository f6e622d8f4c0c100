"""float64 references the suites compare against, written independently of every implementation."""
