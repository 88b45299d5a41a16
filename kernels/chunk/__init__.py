"""Chunkwise templates (issue 3)."""
