"""deepinfer-sg front door (placeholder)."""
