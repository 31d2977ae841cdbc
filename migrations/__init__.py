"""The store's Alembic migrations, installed as ``qlm.migrations`` (``qlm.store.migrate`` runs
them)."""
