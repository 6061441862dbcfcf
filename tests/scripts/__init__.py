"""Scripts the top-level tests launch in their own processes or network namespaces."""
