"""Scripts the strategy tests launch in their own processes (torchrun, Lightning, or python)."""
