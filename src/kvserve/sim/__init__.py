"""sim layer (see DESIGN.md §1)."""
