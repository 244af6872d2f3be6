"""bench layer (see DESIGN.md §1)."""
