"""Planning: memory and time estimates per layout, layout search, dry runs on a fake process group."""
