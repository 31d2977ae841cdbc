"""Alembic revisions (Alembic loads them by path; this file only makes the folder a package)."""
