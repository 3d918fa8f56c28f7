"""Alembic environment: migrations run on the connection the store hands over
(``config.attributes["connection"]``), inside the caller's transaction. For development,
``alembic -x url=sqlite:///some.db -c <ini naming this folder> upgrade head`` also works."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from autospec.store.tables import VERSION_TABLE, Base

config = context.config


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=Base.metadata,
                      version_table=VERSION_TABLE)
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option(
        "sqlalchemy.url")
    engine = create_engine(url)
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()
