"""Scripts the data tests launch in their own processes."""
