"""Alembic scripts of `storage` (a package only so that wheels ship them)."""
