"""router layer (see DESIGN.md §1)."""
