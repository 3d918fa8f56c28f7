"""Alembic migrations of the store's schema (run by ``autospec.store.migrate.upgrade``)."""
