"""engine layer (see DESIGN.md §1)."""
