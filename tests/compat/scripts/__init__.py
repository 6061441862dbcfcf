"""The 0.1.0-API script the compatibility test launches in its own processes."""
