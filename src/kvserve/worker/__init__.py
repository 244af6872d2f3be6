"""worker layer (see DESIGN.md §1)."""
