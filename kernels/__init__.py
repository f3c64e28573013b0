"""(placeholder, filled by the owning issue)"""
